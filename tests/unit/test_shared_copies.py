"""Staged lease copies in shared memory (transfer.shared_copies): the layout arithmetic,
bit-exact reads into a paged cache in every layout, the checks that keep a consumer from
reading anything but the copy it was offered, and descriptors that end with their lease.
Pulls of such copies through the transfer endpoint are in
tests/contract/test_shared_copies_endpoint.py."""

from __future__ import annotations

import os
import time

import pytest
import torch

from foundation import wire
from tests.paged_caches import (
    BLOCK_SIZE,
    CONSUMER_BLOCKS,
    DTYPES,
    LAYOUTS,
    NUM_LAYERS,
    PRODUCER_BLOCKS,
    block_bytes,
    make_cache,
)
from transfer.kv_layout import block_index_tensor, consecutive_runs
from transfer.leases import Lease, LeaseTable
from transfer.shared_copies import SharedCopy, SharedCopyUnavailable, local_host, read_shared_copy, stage_shared

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("positions, local_ids, runs", [
    ([0, 1, 2], [4, 5, 6], [(0, [(4, 3)])]),
    ([0, 1, 2], [4, 9, 5], [(0, [(4, 1), (9, 1), (5, 1)])]),
    ([1, 2, 4], [0, 1, 2], [(1, [(0, 2)]), (4, [(2, 1)])]),
    ([3, 1], [7, 8], [(3, [(7, 1)]), (1, [(8, 1)])]),
    ([], [], []),
])
def test_consecutive_runs(positions, local_ids, runs):
    assert consecutive_runs(positions, local_ids) == runs


def open_lease_copies() -> set[str]:
    """This process's descriptors that name a lease copy."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:kvroute-lease-"):
            names.add(target)
    return names


@pytest.fixture(params=list(DTYPES))
def dtype(request):
    return DTYPES[request.param]


@pytest.fixture(params=list(LAYOUTS))
def layout(request):
    return request.param


@pytest.mark.parametrize("positions", [[0, 1, 2, 3, 4], [2, 3, 4], [0, 2, 4], [3, 1]],
                         ids=["whole", "suffix", "gaps", "reversed"])
def test_a_shared_copy_reads_bit_exactly_into_the_requested_blocks(dtype, layout, positions):
    producer = make_cache(dtype, layout, PRODUCER_BLOCKS, seed=7)
    consumer = make_cache(dtype, layout, CONSUMER_BLOCKS, seed=None)
    lease_blocks = [3, 7, 1, 10, 5]
    layers, shared = stage_shared(producer, block_index_tensor(lease_blocks))
    try:
        assert [layer.data_ptr() for layer in layers] == [
            shared.tensor().data_ptr() + i * len(lease_blocks) * producer.layer_bytes_per_block
            for i in range(NUM_LAYERS)]
        local_ids = [9, 0, 1, 6, 2][: len(positions)]
        nbytes = read_shared_copy(shared.ref(len(lease_blocks)), consumer, local_ids, positions)
    finally:
        shared.close()
    assert nbytes == len(positions) * consumer.spec.bytes_per_block
    for layer in range(NUM_LAYERS):
        for position, local_id in zip(positions, local_ids):
            assert torch.equal(block_bytes(consumer, layer, local_id),
                               block_bytes(producer, layer, lease_blocks[position])), (layer, position)
        for untouched in set(range(CONSUMER_BLOCKS)) - set(local_ids):
            assert not block_bytes(consumer, layer, untouched).any(), (layer, untouched)


def test_a_copy_read_after_its_descriptor_closed_is_refused():
    producer = make_cache(torch.float32, "block-dim-1", PRODUCER_BLOCKS, seed=7)
    consumer = make_cache(torch.float32, "block-dim-1", CONSUMER_BLOCKS, seed=None)
    _, shared = stage_shared(producer, block_index_tensor([1, 2]))
    ref = shared.ref(2)
    shared.close()
    with pytest.raises(SharedCopyUnavailable):
        read_shared_copy(ref, consumer, [0, 1], [0, 1])


def test_a_reused_descriptor_number_is_not_mistaken_for_the_copy():
    """The producer closed the lease's descriptor and the number now names another lease's
    copy: the consumer must notice, not read someone else's blocks."""
    producer = make_cache(torch.float32, "block-dim-0", PRODUCER_BLOCKS, seed=7)
    consumer = make_cache(torch.float32, "block-dim-0", CONSUMER_BLOCKS, seed=None)
    _, first = stage_shared(producer, block_index_tensor([1, 2]))
    _, second = stage_shared(producer, block_index_tensor([3, 4]))
    try:
        stale = wire.SharedCopyRef(pid=os.getpid(), fd=second.fd, name=first.name, num_blocks=2)
        with pytest.raises(SharedCopyUnavailable, match="not the copy"):
            read_shared_copy(stale, consumer, [0, 1], [0, 1])
        not_ours = wire.SharedCopyRef(pid=os.getpid(), fd=0, name=first.name, num_blocks=2)  # stdin
        with pytest.raises(SharedCopyUnavailable):
            read_shared_copy(not_ours, consumer, [0, 1], [0, 1])
    finally:
        first.close()
        second.close()
    assert not any(block_bytes(consumer, 0, block).any() for block in range(CONSUMER_BLOCKS))


def test_positions_outside_the_copy_are_refused_before_any_read():
    producer = make_cache(torch.float32, "block-dim-0", PRODUCER_BLOCKS, seed=7)
    consumer = make_cache(torch.float32, "block-dim-0", CONSUMER_BLOCKS, seed=None)
    _, shared = stage_shared(producer, block_index_tensor([1, 2]))
    try:
        with pytest.raises(IndexError):
            read_shared_copy(shared.ref(2), consumer, [0], [2])
        with pytest.raises(IndexError):
            read_shared_copy(shared.ref(2), consumer, [CONSUMER_BLOCKS], [0])
    finally:
        shared.close()


def test_the_copy_outlives_its_descriptor_for_tensors_that_still_use_it():
    """Frames of a pull may still be on their way when the lease ends."""
    producer = make_cache(torch.bfloat16, "block-dim-1", PRODUCER_BLOCKS, seed=7)
    layers, shared = stage_shared(producer, block_index_tensor([4, 5]))
    expected = [layer.clone() for layer in layers]
    shared.close()
    shared.close()  # idempotent
    del shared
    assert all(torch.equal(layer, copy) for layer, copy in zip(layers, expected))


def _staged_lease(table: LeaseTable, cache, block_ids) -> tuple[Lease, SharedCopy]:
    lease = Lease("h" * 32, "req", tuple(block_ids), len(block_ids) * BLOCK_SIZE, time.monotonic() + 60)
    table.grant(lease, staging_bytes=len(block_ids) * cache.spec.bytes_per_block)
    layers, shared = stage_shared(cache, block_index_tensor(block_ids))
    return lease, shared, layers


@pytest.mark.parametrize("end", ["release", "expire", "release_all"])
def test_a_lease_closes_its_shared_copy_when_it_ends(end):
    cache = make_cache(torch.float32, "block-dim-0", PRODUCER_BLOCKS, seed=7)
    table = LeaseTable()
    before = open_lease_copies()
    lease, shared, layers = _staged_lease(table, cache, [1, 2, 3])
    assert table.finish_staging(lease.handle, layers, shared)
    assert table.get(lease.handle).shared is shared
    assert len(open_lease_copies() - before) == 1
    {"release": lambda: table.release(lease.handle), "expire": lambda: table.expire(time.monotonic() + 120),
     "release_all": table.release_all}[end]()
    assert shared.closed
    del shared, layers  # the mapping (and the descriptor Python's mmap keeps) goes with its last tensor
    assert open_lease_copies() == before


def test_a_lease_ended_while_staging_closes_the_copy_when_staging_finishes():
    cache = make_cache(torch.float32, "block-dim-0", PRODUCER_BLOCKS, seed=7)
    table = LeaseTable()
    before = open_lease_copies()
    lease, shared, layers = _staged_lease(table, cache, [1, 2])
    assert table.release(lease.handle)
    assert not table.finish_staging(lease.handle, layers, shared)
    assert shared.closed
    del shared, layers
    assert open_lease_copies() == before
    assert table.take_ended_request_ids() == {"req"} and table.staged_bytes == 0


def test_local_host_names_this_pid_namespace():
    assert local_host().endswith(os.readlink("/proc/self/ns/pid"))
    assert local_host() == local_host()
