"""Per-frame checksums: an xxh3-64 digest of every frame, made by the sender from the bytes
it sends and checked by the receiver before the frame is stored.

They catch bytes changed between the producer's buffer and the consumer's cache: a send
buffer rewritten while its zero-copy send was still in flight, a faulty NIC or memory, a
frame of an abandoned pull taken for the next one. A producer computes them itself, so
they prove nothing about a producer that lies; the header checks
(``transfer.pull_check``) and CURVE's authentication answer that. Digests travel beside
their frames (each backend says how), eight bytes a frame, in frame order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import xxhash

from transfer.transports.errors import FrameMismatch

DIGEST_BYTES = 8


class ChecksumMismatch(FrameMismatch):
    """A frame's bytes do not match the digest its sender computed."""


def _host_bytes(data: torch.Tensor | memoryview | bytes) -> memoryview | bytes:
    if not isinstance(data, torch.Tensor):
        return data
    if data.device.type != "cpu":  # a CUDA frame is hashed from a host copy (NCCL links)
        data = data.cpu()
    return memoryview(data.contiguous().view(torch.uint8).numpy())


def frame_digest(data: torch.Tensor | memoryview | bytes) -> bytes:
    """The digest of one frame's bytes."""
    return xxhash.xxh3_64_digest(_host_bytes(data))


def parts_digest(parts: Iterable[torch.Tensor]) -> bytes:
    """The digest of consecutive parts, as ``frame_digest`` of their concatenation: a frame
    checked where its bytes lie (a direct READ's rows in a paged cache) without gathering it."""
    state = xxhash.xxh3_64()
    for part in parts:
        state.update(_host_bytes(part))
    return state.digest()


def group_digests(frames: Sequence[torch.Tensor]) -> bytes:
    """The digests of consecutive frames, in order: what travels with one message."""
    return b"".join(frame_digest(frame) for frame in frames)


def check_frame(index: int, data: torch.Tensor | memoryview | bytes, digests: bytes, position: int = 0) -> None:
    """Raise ChecksumMismatch unless frame ``index`` matches the ``position``-th digest of ``digests``."""
    expected = digests[position * DIGEST_BYTES:(position + 1) * DIGEST_BYTES]
    if len(expected) != DIGEST_BYTES:
        raise ChecksumMismatch(f"frame {index}: no digest came with it ({len(digests)} digest bytes)")
    if frame_digest(data) != expected:
        raise ChecksumMismatch(f"frame {index}: its bytes do not match the sender's checksum")
