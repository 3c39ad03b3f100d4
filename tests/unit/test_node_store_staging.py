"""Staging a write-through (transfer.node_store.cache_io): the blocks land in wire format at
the start of the copy, and copies are reused instead of faulting in new memory each time."""

from __future__ import annotations

import torch

from tests.paged_caches import DTYPES, PRODUCER_BLOCKS, make_cache
from transfer.kv_layout import block_index_tensor
from transfer.node_store.cache_io import StagingPool


def cache():
    return make_cache(DTYPES["bfloat16"], "block-dim-1", PRODUCER_BLOCKS, seed=1)


def test_the_staged_bytes_are_the_blocks_in_wire_format():
    source = cache()
    copy = StagingPool().stage(source, [4, 1])
    nbytes = 2 * source.spec.bytes_per_block
    expected = torch.cat(source.copy_blocks(block_index_tensor([4, 1])))
    assert torch.equal(copy.tensor()[:nbytes], expected)
    copy.close()


def test_a_copy_given_back_is_reused_when_it_is_big_enough():
    source, pool = cache(), StagingPool()
    big = pool.stage(source, [0, 1, 2])
    pool.give_back(big)
    small = pool.stage(source, [5])
    assert small is big, "a copy big enough is reused"
    assert pool.stage(source, [0, 1, 2, 3]) is not big, "a bigger one is made when none fits"
    pool.close()


def test_idle_copies_are_bounded():
    source = cache()
    pool = StagingPool(max_idle_bytes=2 * source.spec.bytes_per_block)
    copies = [pool.stage(source, [0]) for _ in range(3)]
    for copy in copies:
        pool.give_back(copy)
    assert sum(not copy.closed for copy in copies) == 2, "beyond the bound, idle copies are closed"
    pool.close()
    assert all(copy.closed for copy in copies)
