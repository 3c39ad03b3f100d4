"""Staged lease copies in shared memory (transfer.shared_copies): the layout arithmetic,
bit-exact reads into a paged cache in every layout, the checks that keep a consumer from
reading anything but the copy it was offered, and descriptors that end with their lease."""

from __future__ import annotations

import os
import time

import pytest
import torch

from foundation import wire
from foundation.endpoint_client import PullFailed, fetch_transfer_stats, release_lease
from tests.test_transfer_contract import (
    BLOCK_SIZE,
    CONSUMER_BLOCKS,
    DTYPES,
    LAYOUTS,
    NUM_LAYERS,
    PRODUCER_BLOCKS,
    Producer,
    block_bytes,
    make_cache,
)
from transfer import block_client
from transfer.block_client import pull_blocks
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


# ---------------------------------------------------------------- through the transfer endpoint


@pytest.fixture
def consumer(dtype, layout):
    return make_cache(dtype, layout, CONSUMER_BLOCKS, seed=None)


@pytest.fixture
def producer(dtype, layout):
    with Producer(dtype, layout).serving() as producer:
        yield producer


def stage_on(producer: Producer, block_ids) -> tuple[Lease, wire.PullSource]:
    """A lease staged in shared memory, as the producer's connector stages it."""
    lease, source = producer.lease(block_ids, grant=False)
    producer.leases.grant(lease, staging_bytes=len(block_ids) * producer.cache.spec.bytes_per_block)
    layers, shared = stage_shared(producer.cache, block_index_tensor(block_ids))
    producer.leases.finish_staging(lease.handle, layers, shared)
    return lease, source


def pull(context, consumer, source, positions, local_ids, read_shared=None) -> int:
    local = block_index_tensor(local_ids)
    return pull_blocks(context, source, positions, consumer.spec,
                       lambda layer, data: consumer.scatter_layer(layer, local, data),
                       time.monotonic() + 5, read_shared=read_shared)


def reader(consumer, local_ids, positions, calls: list):
    def read(ref):
        calls.append(ref)
        return read_shared_copy(ref, consumer, local_ids, positions)
    return read


def assert_blocks(producer: Producer, consumer, lease_blocks, positions, local_ids) -> None:
    for layer in range(NUM_LAYERS):
        for position, local_id in zip(positions, local_ids):
            assert torch.equal(block_bytes(consumer, layer, local_id),
                               block_bytes(producer.cache, layer, lease_blocks[position])), (layer, position)


def test_a_consumer_on_this_host_reads_the_shared_copy(producer, consumer, context):
    lease_blocks, positions, local_ids = (3, 7, 1, 10), [1, 2, 3], [4, 0, 8]
    lease, source = stage_on(producer, lease_blocks)
    calls = []
    nbytes = pull(context, consumer, source, positions, local_ids, reader(consumer, local_ids, positions, calls))
    assert nbytes == len(positions) * consumer.spec.bytes_per_block and len(calls) == 1
    assert_blocks(producer, consumer, lease_blocks, positions, local_ids)
    counters = fetch_transfer_stats(context, producer.address).counters
    assert counters.shared_pulls == 1 and counters.bytes_sent == nbytes and counters.blocks_sent == 3
    assert release_lease(context, producer.address, lease.handle, "ack")


def test_frames_without_a_reader_or_from_another_host(producer, consumer, context, monkeypatch):
    lease_blocks = (2, 5)
    _, source = stage_on(producer, lease_blocks)
    assert pull(context, consumer, source, [0, 1], [1, 2]) == 2 * consumer.spec.bytes_per_block
    monkeypatch.setattr(block_client, "local_host", lambda: "another-machine/boot/pid:[1]")
    calls = []
    assert pull(context, consumer, source, [0, 1], [3, 4], reader(consumer, [3, 4], [0, 1], calls)) > 0
    assert calls == []
    assert_blocks(producer, consumer, lease_blocks, [0, 1, 0, 1], [1, 2, 3, 4])
    assert fetch_transfer_stats(context, producer.address).counters.shared_pulls == 0


def test_an_unreadable_shared_copy_falls_back_to_frames(producer, consumer, context, caplog):
    lease_blocks, positions, local_ids = (6, 4, 9), [0, 1, 2], [7, 3, 5]
    _, source = stage_on(producer, lease_blocks)

    def refuse(ref):
        consumer.layers[0].view(torch.uint8).fill_(1)  # a read that failed half way
        raise SharedCopyUnavailable("no permission")
    consumer_layer0 = consumer.layers[0]
    assert pull(context, consumer, source, positions, local_ids, refuse) == 3 * consumer.spec.bytes_per_block
    assert_blocks(producer, consumer, lease_blocks, positions, local_ids)
    assert consumer_layer0 is consumer.layers[0]
    assert "pulling its layers as frames" in caplog.text
    counters = fetch_transfer_stats(context, producer.address).counters
    assert counters.shared_pulls == 1 and counters.blocks_sent == 6  # offered, then sent as frames


def test_a_lease_that_ends_between_offer_and_read_fails_the_pull(producer, consumer, context):
    """The consumer then recomputes; it never reads another lease's memory."""
    lease, source = stage_on(producer, (1, 2))

    def late(ref):
        producer.leases.release(lease.handle)
        return read_shared_copy(ref, consumer, [0, 1], [0, 1])
    with pytest.raises(PullFailed):
        pull(context, consumer, source, [0, 1], [0, 1], late)


def _pull_in_child(source, layout_name, dtype_name, positions, local_ids, queue):
    """A consumer in a process of its own, as a decode worker's is."""
    import zmq as child_zmq
    consumer = make_cache(DTYPES[dtype_name], layout_name, CONSUMER_BLOCKS, seed=None)
    context = child_zmq.Context()
    calls = []
    try:
        nbytes = pull(context, consumer, source, positions, local_ids, reader(consumer, local_ids, positions, calls))
        queue.put((nbytes, len(calls), [layer.view(torch.uint8).numpy().tobytes() for layer in consumer.layers]))
    finally:
        context.destroy(linger=0)


def test_a_consumer_in_another_process_reads_the_copy(context):
    import multiprocessing
    with Producer(torch.bfloat16, "block-dim-1").serving() as producer:
        lease_blocks, positions, local_ids = (3, 7, 1, 10, 5), [0, 1, 2, 3, 4], [9, 0, 4, 6, 2]
        lease, source = stage_on(producer, lease_blocks)
        spawn = multiprocessing.get_context("spawn")
        queue = spawn.Queue()
        child = spawn.Process(target=_pull_in_child,
                              args=(source, "block-dim-1", "bfloat16", positions, local_ids, queue))
        child.start()
        nbytes, reads, layers = queue.get(timeout=50)
        child.join(10)
        assert child.exitcode == 0 and reads == 1 and nbytes == len(positions) * producer.cache.spec.bytes_per_block
        consumer = make_cache(torch.bfloat16, "block-dim-1", CONSUMER_BLOCKS, seed=None)
        for mine, theirs in zip(consumer.layers, layers):
            mine.view(torch.uint8).view(-1).copy_(torch.frombuffer(bytearray(theirs), dtype=torch.uint8))
        assert_blocks(producer, consumer, lease_blocks, positions, local_ids)
        assert fetch_transfer_stats(context, producer.address).counters.shared_pulls == 1
        assert release_lease(context, producer.address, lease.handle, "ack")
