"""Where a direct READ's bytes come from and go to: pure arithmetic on block tables.

A staged lease's copy holds each layer's blocks in wire format (``PagedKVCache.copy_blocks``):
under each leading index (keys, then values, for a layout that splits them before the block
dimension), the lease's blocks in order, one row each. A paged cache holds the same rows at
its own block ids. So copying positions ``p`` of a copy into local blocks ``b`` is a list of
contiguous segments, the same in every layer::

    copy layer:  [lead 0: pos 0 | pos 1 | pos 2 ...][lead 1: pos 0 | pos 1 | pos 2 ...]
                          └──────┬──────┘                     └──────┬──────┘
    cache layer: [lead 0: ... blk 4 | blk 5 ...    ][lead 1: ... blk 4 | blk 5 ...    ]

Runs of consecutive positions landing in consecutive blocks make one segment each; a
segment in the copy's order is also the order of the frame ``gather_layer`` would make,
so digests of a frame and of its segments agree (``checksums.parts_digest``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from transfer.kv_layout import consecutive_runs
from transfer.transports.checksums import parts_digest


def layer_segments(positions: Sequence[int], local_block_ids: Sequence[int], copy_blocks: int,
                   cache_blocks: int, leads: int, row_bytes: int) -> np.ndarray:
    """Per segment (offset in a layer's copy, offset in a layer of the cache, bytes), in the
    copy's wire order for these positions. Raises IndexError for a position outside the copy
    or a block outside the cache."""
    _check_range(positions, copy_blocks, "position")
    _check_range(local_block_ids, cache_blocks, "block id")
    segments = []
    for lead in range(leads):
        for first_position, runs in consecutive_runs(positions, local_block_ids):
            position = first_position
            for first_block, count in runs:
                segments.append(((lead * copy_blocks + position) * row_bytes,
                                 (lead * cache_blocks + first_block) * row_bytes, count * row_bytes))
                position += count
    return np.array(segments, dtype=np.int64).reshape(-1, 3)


def read_descriptors(segments: np.ndarray, remote_layers: Sequence[int],
                     local_layers: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """NIXL descriptor lists (address, bytes, device 0) for every layer's segments, layer after
    layer: (local, remote), row i of one paired with row i of the other."""
    if len(remote_layers) != len(local_layers):
        raise ValueError(f"{len(remote_layers)} remote layers for {len(local_layers)} local ones")
    count, layers = len(segments), len(local_layers)
    local = np.zeros((layers, count, 3), dtype=np.int64)
    remote = np.zeros_like(local)
    # All layers at once (a loop over them cost ~60 us a pull for 24 layers, on the pull's path).
    remote[:, :, 0] = np.asarray(remote_layers, dtype=np.int64)[:, None] + segments[:, 0]
    local[:, :, 0] = np.asarray(local_layers, dtype=np.int64)[:, None] + segments[:, 1]
    remote[:, :, 1] = local[:, :, 1] = segments[:, 2]
    return local.reshape(-1, 3), remote.reshape(-1, 3)


def _check_range(values: Sequence[int], limit: int, what: str) -> None:
    for value in values:
        if not 0 <= value < limit:
            raise IndexError(f"{what} {value} outside 0..{limit - 1}")


def segments_digest(layer_bytes: torch.Tensor, starts: np.ndarray, sizes: np.ndarray) -> bytes:
    """The digest of a layer's segments (one column of ``layer_segments``) in order, read
    where they lie in ``layer_bytes`` (the layer as flat bytes): equal to ``frame_digest`` of
    the frame ``gather_layer`` would make of the same blocks."""
    return parts_digest(layer_bytes[start:start + size] for start, size in zip(starts.tolist(), sizes.tolist()))
