"""The segments of a direct READ (transfer.direct_descriptors): copying them byte for byte
between a staged copy and a paged cache equals gathering the positions and scattering them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.paged_caches import LAYOUTS, make_cache
from transfer.direct_descriptors import layer_segments, read_descriptors, segments_digest
from transfer.kv_layout import block_index_tensor
from transfer.transports.checksums import frame_digest


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("positions, local_ids", [
    ([0, 1, 2], [4, 5, 6]),  # one run into consecutive blocks: one segment per lead
    ([1, 3], [7, 2]),  # a delta pull into scattered blocks
    ([2, 3, 4], [0, 1, 9]),  # a run of positions split across blocks
    ([], []),
])
def test_copying_the_segments_equals_gather_then_scatter(layout, positions, local_ids):
    producer = make_cache(torch.bfloat16, layout, 6, seed=7)
    copy = producer.copy_blocks(block_index_tensor(range(6)))
    expected = make_cache(torch.bfloat16, layout, 10, seed=None)
    actual = make_cache(torch.bfloat16, layout, 10, seed=None)
    leads, row_bytes = actual.row_geometry()
    segments = layer_segments(positions, local_ids, 6, 10, leads, row_bytes)
    for layer in range(len(copy)):
        frame = torch.empty(len(positions) * producer.layer_bytes_per_block, dtype=torch.uint8)
        producer.select_from_copy(copy[layer], block_index_tensor(positions), frame)
        expected.scatter_layer(layer, block_index_tensor(local_ids), frame)
        target = actual.layers[layer].reshape(-1).view(torch.uint8)
        for source_offset, target_offset, nbytes in segments.tolist():
            target[target_offset:target_offset + nbytes] = copy[layer][source_offset:source_offset + nbytes]
        assert torch.equal(actual.layers[layer].view(torch.uint8), expected.layers[layer].view(torch.uint8))
        assert segments_digest(target, segments[:, 1], segments[:, 2]) == frame_digest(frame)
    if positions == [0, 1, 2]:
        assert len(segments) == leads


def test_descriptors_pair_every_layer_segment():
    segments = np.array([[0, 100, 10], [50, 300, 20]], dtype=np.int64)
    local, remote = read_descriptors(segments, [1000, 2000], [5000, 6000])
    assert local.tolist() == [[5100, 10, 0], [5300, 20, 0], [6100, 10, 0], [6300, 20, 0]]
    assert remote.tolist() == [[1000, 10, 0], [1050, 20, 0], [2000, 10, 0], [2050, 20, 0]]


def test_positions_and_blocks_out_of_range_are_refused():
    with pytest.raises(IndexError, match="position 6"):
        layer_segments([6], [0], 6, 10, 1, 64)
    with pytest.raises(IndexError, match="block id 10"):
        layer_segments([0], [10], 6, 10, 1, 64)
