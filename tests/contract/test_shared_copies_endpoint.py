"""Staged lease copies in shared memory (transfer.shared_copies) pulled through a real
transfer endpoint: a consumer on this host reads the copy it is offered, in this process or
another, falls back to frames where it cannot, and never reads a copy whose lease ended.
A lease in the staging arena (a producer hosting nixl) is offered the same way, pinned, to a
consumer that confirms its read; the region is not reused while pinned, a read that outlived
its lease fails, and a consumer that does not confirm gets frames."""

from __future__ import annotations

import time

import pytest
import torch

from foundation import wire
from foundation.endpoint_client import PullFailed, exchange, fetch_transfer_stats, release_lease
from tests.contract.transfer_endpoint import Producer, stage_arena_lease, stage_shared_lease
from tests.paged_caches import CONSUMER_BLOCKS, DTYPES, LAYOUTS, NUM_LAYERS, block_bytes, make_cache
from transfer import block_client
from transfer.block_client import pull_blocks
from transfer.kv_layout import block_index_tensor
from transfer.shared_copies import SharedCopyUnavailable, local_host, read_shared_copy

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=list(DTYPES))
def dtype(request):
    return DTYPES[request.param]


@pytest.fixture(params=list(LAYOUTS))
def layout(request):
    return request.param


@pytest.fixture
def consumer(dtype, layout):
    return make_cache(dtype, layout, CONSUMER_BLOCKS, seed=None)


@pytest.fixture
def producer(dtype, layout):
    with Producer(dtype, layout).serving() as producer:
        yield producer


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
    lease, source = stage_shared_lease(producer, lease_blocks)
    calls = []
    nbytes = pull(context, consumer, source, positions, local_ids, reader(consumer, local_ids, positions, calls))
    assert nbytes == len(positions) * consumer.spec.bytes_per_block and len(calls) == 1
    assert_blocks(producer, consumer, lease_blocks, positions, local_ids)
    counters = fetch_transfer_stats(context, producer.address).counters
    assert counters.shared_pulls == 1 and counters.bytes_sent == nbytes and counters.blocks_sent == 3
    assert release_lease(context, producer.address, lease.handle, "ack")


def test_frames_without_a_reader_or_from_another_host(producer, consumer, context, monkeypatch):
    lease_blocks = (2, 5)
    _, source = stage_shared_lease(producer, lease_blocks)
    assert pull(context, consumer, source, [0, 1], [1, 2]) == 2 * consumer.spec.bytes_per_block
    monkeypatch.setattr(block_client, "local_host", lambda: "another-machine/boot/pid:[1]")
    calls = []
    assert pull(context, consumer, source, [0, 1], [3, 4], reader(consumer, [3, 4], [0, 1], calls)) > 0
    assert calls == []
    assert_blocks(producer, consumer, lease_blocks, [0, 1, 0, 1], [1, 2, 3, 4])
    assert fetch_transfer_stats(context, producer.address).counters.shared_pulls == 0


def test_an_unreadable_shared_copy_falls_back_to_frames(producer, consumer, context, caplog):
    lease_blocks, positions, local_ids = (6, 4, 9), [0, 1, 2], [7, 3, 5]
    _, source = stage_shared_lease(producer, lease_blocks)

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
    lease, source = stage_shared_lease(producer, (1, 2))

    def late(ref):
        producer.leases.release(lease.handle)
        return read_shared_copy(ref, consumer, [0, 1], [0, 1])
    with pytest.raises(PullFailed):
        pull(context, consumer, source, [0, 1], [0, 1], late)


def test_a_lease_in_the_arena_is_read_as_a_shared_copy_and_confirmed(producer, consumer, context):
    lease_blocks, positions, local_ids = (3, 7, 1, 10), [1, 2, 3], [4, 0, 8]
    stage_arena_lease(producer, (0, 2))  # the lease below lies past the start of the arena's file
    lease, source = stage_arena_lease(producer, lease_blocks)
    calls = []
    nbytes = pull(context, consumer, source, positions, local_ids, reader(consumer, local_ids, positions, calls))
    assert nbytes == len(positions) * consumer.spec.bytes_per_block
    [ref] = calls
    assert ref.offset == lease.region.offset > 0 and ref.pin > 0
    assert_blocks(producer, consumer, lease_blocks, positions, local_ids)
    assert fetch_transfer_stats(context, producer.address).counters.shared_pulls == 1
    assert not producer.server.direct.pinned  # the confirmation let the pin go
    assert release_lease(context, producer.address, lease.handle, "ack")


def test_a_pinned_arena_lease_is_not_reused_and_a_read_past_its_lease_fails(producer, consumer, context):
    """The consumer then recomputes: what it read may be another lease's, and it is never trusted."""
    lease, source = stage_arena_lease(producer, (1, 2))
    others = []

    def late(ref):
        producer.leases.release(lease.handle)  # the lease ends while its read is pinned
        others.append(stage_arena_lease(producer, (3, 4))[0].region)
        return read_shared_copy(ref, consumer, [0, 1], [0, 1])
    with pytest.raises(PullFailed, match="did not confirm"):
        pull(context, consumer, source, [0, 1], [0, 1], late)
    assert others[0].offset != lease.region.offset, "a pinned region was handed to another lease"
    assert_blocks(producer, consumer, (1, 2), [0, 1], [0, 1])  # the read still saw the old lease


def test_a_consumer_that_does_not_confirm_gets_an_arena_lease_as_frames(producer, consumer, context):
    """One from before shared reads were confirmed: it would read from the file's start."""
    _, source = stage_arena_lease(producer, (1, 2))
    request = wire.PullBlocks(handle=source.handle, block_indices=[0, 1], layout=consumer.spec, host=local_host())
    with exchange(context, producer.address, time.monotonic() + 5, None) as channel:
        channel.send(request)
        header = channel.receive_message()
        frames = [channel.receive_frame() for _ in range(header.num_layers)]
    assert header.ok and header.shared_copy is None and len(frames) == NUM_LAYERS
    assert fetch_transfer_stats(context, producer.address).counters.shared_pulls == 0


def _pull_in_child(source, layout_name, dtype_name, positions, local_ids, queue):
    """A consumer in a process of its own, as a decode worker's is."""
    import zmq as child_zmq

    from foundation import zmq_auth
    zmq_auth.configure_from_environment("worker")  # a spawned child: the run's keys, as a worker
    consumer = make_cache(DTYPES[dtype_name], layout_name, CONSUMER_BLOCKS, seed=None)
    context = child_zmq.Context()
    calls = []
    try:
        nbytes = pull(context, consumer, source, positions, local_ids, reader(consumer, local_ids, positions, calls))
        queue.put((nbytes, len(calls), [layer.view(torch.uint8).numpy().tobytes() for layer in consumer.layers]))
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize("stage", [stage_shared_lease, stage_arena_lease], ids=["memfd", "arena"])
def test_a_consumer_in_another_process_reads_the_copy(context, stage):
    import multiprocessing
    with Producer(torch.bfloat16, "block-dim-1").serving() as producer:
        lease_blocks, positions, local_ids = (3, 7, 1, 10, 5), [0, 1, 2, 3, 4], [9, 0, 4, 6, 2]
        lease, source = stage(producer, lease_blocks)
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
