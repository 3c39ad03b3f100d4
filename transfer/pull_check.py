"""The consumer's check of a producer's answer to a pull, before any byte reaches its cache.

A producer answers a pull with a ``PullHeader``; the consumer then writes what follows
into blocks vLLM allocated for the request, and vLLM reads them as the prompt's KV as
soon as the pull is reported done. So nothing the producer says is taken on trust: its
layout must equal ours field by field (layers, heads, head size, block size, dtype and
so bytes per block), it must serve exactly the positions asked for, in order, with
frames of the size those blocks take, and with checksums when they were asked for. A
header that disagrees anywhere refuses the pull (``PullRefused``), which the connector
reports to vLLM as a failed load: the request is recomputed.
"""

from __future__ import annotations

from foundation import wire
from foundation.endpoint_client import PullFailed
from transfer.kv_layout import layout_differences
from transfer.transports.checksums import DIGEST_BYTES


class PullRefused(PullFailed):
    """The producer's answer disagrees with the pull; nothing was written."""


class CorruptFrame(PullFailed):
    """A frame did not match its checksum; the pull is abandoned before that frame is stored."""


def header_differences(header: wire.PullHeader, request: wire.PullBlocks | wire.PullOverLink) -> list[str]:
    """Each way in which an ``ok`` header disagrees with the pull it answers."""
    layout = request.layout
    expected_frame = len(request.block_indices) * (layout.bytes_per_block // layout.num_layers)
    differences = [f"{what} {got!r}, expected {wanted!r}" for what, got, wanted in (
        ("layers", header.num_layers, layout.num_layers),
        ("blocks", header.num_blocks, len(request.block_indices)),
        ("positions", header.block_indices, list(request.block_indices)),
        ("frame bytes", header.frame_bytes, expected_frame),
        ("checksums", header.checksum, request.checksum and header.shared_copy is None),
    ) if got != wanted]
    if header.layout is None:
        differences.append("no layout")
    else:
        differences += [f"layout {difference}" for difference in layout_differences(layout, header.layout)]
    if header.direct is not None:
        differences += _direct_differences(header.direct, request)
    if header.shared_copy is not None and header.shared_copy.num_blocks <= max(request.block_indices, default=-1):
        differences.append(f"a shared copy of {header.shared_copy.num_blocks} blocks for positions "
                           f"up to {max(request.block_indices)}")
    return differences


def _direct_differences(direct: wire.DirectRef, request: wire.PullBlocks | wire.PullOverLink) -> list[str]:
    layout = request.layout
    differences = []
    if not getattr(request, "direct", False):
        differences.append("a direct copy, which was not asked for")
    if len(direct.layer_offsets) != layout.num_layers:
        differences.append(f"a direct copy of {len(direct.layer_offsets)} layers")
    copy_bytes = direct.num_blocks * layout.bytes_per_block // max(layout.num_layers, 1)
    if any(not 0 <= offset <= direct.arena_bytes - copy_bytes for offset in direct.layer_offsets):
        differences.append(f"a direct copy lying outside its arena of {direct.arena_bytes} bytes")
    if direct.num_blocks <= max(request.block_indices, default=-1):
        differences.append(f"a direct copy of {direct.num_blocks} blocks for positions up to "
                           f"{max(request.block_indices)}")
    digest_bytes = len(direct.digests) if direct.digests is not None else 0
    if digest_bytes != (DIGEST_BYTES * layout.num_layers if request.checksum else 0):
        differences.append(f"{digest_bytes} bytes of digests with a direct copy")
    return differences


def check_pull_header(header: wire.Message, request: wire.PullBlocks | wire.PullOverLink) -> wire.PullHeader:
    """The header, if the producer accepted the pull and agrees with it in every field;
    raises PullFailed on a refusal, PullRefused on any disagreement."""
    if not isinstance(header, wire.PullHeader) or not header.ok:
        raise PullFailed(f"producer refused the pull: {getattr(header, 'error', header)}")
    differences = header_differences(header, request)
    if differences:
        raise PullRefused("the producer's answer disagrees with the pull, refusing it before writing: "
                          + "; ".join(differences))
    return header
