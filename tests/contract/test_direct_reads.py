"""Direct NIXL READs of staged leases into a paged cache (transfer.direct_reads), pulled through a
real transfer endpoint: bit-exact in every dtype and layout, only the blocks asked for, one
registration per cache and one load of the producer's arena however many leases, arena memory
reused lease after lease at the same addresses, and never trusted once the lease ended or the
producer died."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from foundation.endpoint_client import PullFailed, fetch_transfer_stats, release_lease
from foundation.netutil import free_port, tcp
from foundation.wire import PullSource
from tests.contract.transfer_endpoint import Producer, assert_pulled, consumer_connector, run_loads, stage_arena_lease
from tests.paged_caches import BLOCK_SIZE, CONSUMER_BLOCKS, LAYOUTS, PRODUCER_BLOCKS, block_bytes, make_cache
from transfer.block_client import pull_blocks
from transfer.connector_worker import ConnectorWorker
from transfer.direct_reads import DirectReader
from transfer.kv_layout import block_index_tensor
from transfer.metadata import KVRouteConnectorMetadata, LeaseGrant, LoadSpec
from transfer.pull_check import CorruptFrame
from transfer.settings import ConnectorSettings
from transfer.transports.nixl_agent import nixl_missing

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(bool(nixl_missing()), reason="nixl_cu12 is not installed")]

# As the transports' contract suite: every dtype a KV cache comes in, both block layouts.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.int8, "uint8": torch.uint8}
DEADLINE_SECONDS = 5.0


@pytest.fixture(params=list(LAYOUTS))
def layout(request):
    return request.param


@pytest.fixture
def reader_of():
    """Makes a test's DirectReader; each deregisters its cache at the end, as a connector's does at
    shutdown, before the cache's memory can be reused by the next test."""
    readers = []
    yield lambda cache: readers.append(DirectReader(cache, "127.0.0.1")) or readers[-1]
    for reader in readers:
        reader.close()


def direct_pull(context, reader: DirectReader, source, positions, local_ids, checksum: bool = False,
                before_read=lambda ref: None, deadline_seconds: float = DEADLINE_SECONDS,
                expect_direct: bool = True) -> int:
    """A pull as the connector makes it with a nixl link: frames only if the producer cannot
    offer the lease directly (``expect_direct`` False: it must not)."""
    deadline = time.monotonic() + deadline_seconds
    local = block_index_tensor(local_ids)
    scattered = []

    def read(ref) -> int:
        before_read(ref)
        return reader.read(ref, list(local_ids), list(positions), deadline)
    nbytes = pull_blocks(context, source, positions, reader._cache.spec,
                         lambda layer, data: scattered.append(reader._cache.scatter_layer(layer, local, data)),
                         deadline, checksum=checksum, read_direct=read)
    assert bool(scattered) != expect_direct, "frames where a direct READ was due, or the reverse"
    return nbytes


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "checksummed"])
def test_a_consumer_reads_a_lease_straight_into_its_cache(context, reader_of, dtype_name, layout, checksum):
    dtype = DTYPES[dtype_name]
    consumer = make_cache(dtype, layout, CONSUMER_BLOCKS, seed=None)
    reader = reader_of(consumer)
    with Producer(dtype, layout).serving() as producer:
        lease_blocks, positions, local_ids = (3, 7, 1, 10, 5), [0, 1, 2, 3, 4], [4, 5, 6, 0, 8]
        lease, source = stage_arena_lease(producer, lease_blocks)
        nbytes = direct_pull(context, reader, source, positions, local_ids, checksum=checksum)
        assert nbytes == len(positions) * consumer.spec.bytes_per_block
        assert_pulled(producer, consumer, lease_blocks, local_ids)
        counters = fetch_transfer_stats(context, producer.address).counters
        assert counters.direct_pulls == 1 and counters.blocks_sent == 5 and counters.shared_pulls == 0
        assert release_lease(context, producer.address, lease.handle, "ack")


def test_only_the_requested_blocks_move(context, reader_of, layout):
    """A delta pull: positions 1 and 3 of the lease, into scattered blocks; the rest stays zero."""
    consumer = make_cache(torch.bfloat16, layout, CONSUMER_BLOCKS, seed=None)
    reader = reader_of(consumer)
    with Producer(torch.bfloat16, layout).serving() as producer:
        lease_blocks = (2, 9, 4, 11)
        _, source = stage_arena_lease(producer, lease_blocks)
        assert direct_pull(context, reader, source, [1, 3], [7, 2]) == 2 * consumer.spec.bytes_per_block
        assert_pulled(producer, consumer, (9, 11), (7, 2))


def test_registrations_are_made_once_per_cache_and_per_arena(context, reader_of):
    consumer = make_cache(torch.float32, "block-dim-1", CONSUMER_BLOCKS, seed=None)
    reader = reader_of(consumer)
    refs = []
    with Producer(torch.float32, "block-dim-1").serving() as producer:
        first, first_source = stage_arena_lease(producer, (1, 2, 3))
        second, second_source = stage_arena_lease(producer, (4, 5))
        for source, positions, local_ids in ((first_source, [0], [0]), (first_source, [1, 2], [1, 2]),
                                             (second_source, [0, 1], [3, 4]), (second_source, [1], [5])):
            direct_pull(context, reader, source, positions, local_ids, before_read=refs.append)
        assert reader.num_registrations == 1  # the consumer's cache, once
        assert reader.num_peer_loads == 1  # the producer's agent and arena, once for both leases
        assert len({(ref.agent, ref.metadata, ref.arena_address) for ref in refs}) == 1
        assert_pulled(producer, consumer, (1, 2, 3, 4, 5, 5), (0, 1, 2, 3, 4, 5))
        for lease in (first, second):
            assert release_lease(context, producer.address, lease.handle, "ack")
        assert not producer.server.direct.pinned, "confirmed pulls kept their pins"


def test_arena_memory_is_reused_by_lease_after_lease(context, reader_of):
    """Many leases in one process, each staged where an ended one lay: every READ finds the new
    lease's bytes (a registration per lease made NIXL find an old one's there and refuse)."""
    consumer = make_cache(torch.bfloat16, "block-dim-0", CONSUMER_BLOCKS, seed=None)
    reader = reader_of(consumer)
    with Producer(torch.bfloat16, "block-dim-0").serving() as producer:
        offsets = []
        for round_ in range(40):
            lease_blocks = tuple((round_ + step) % PRODUCER_BLOCKS for step in range(1 + round_ % 4))
            local_ids = list(range(len(lease_blocks)))
            for layer in consumer.layers:
                layer.zero_()
            lease, source = stage_arena_lease(producer, lease_blocks)
            offsets.append(lease.region.offset)
            direct_pull(context, reader, source, local_ids, local_ids)
            assert_pulled(producer, consumer, lease_blocks, local_ids)
            assert release_lease(context, producer.address, lease.handle, "ack")
        assert len(set(offsets)) < len(offsets) / 4, "ended leases' memory was not reused"
        assert reader.num_peer_loads == 1


def test_a_pinned_region_is_not_reused_until_its_read_is_confirmed(context, reader_of):
    consumer = make_cache(torch.bfloat16, "block-dim-0", CONSUMER_BLOCKS, seed=None)
    reader = reader_of(consumer)
    with Producer(torch.bfloat16, "block-dim-0").serving() as producer:
        lease, source = stage_arena_lease(producer, (1, 2))
        regions = []

        def end_then_stage_another(ref):
            producer.leases.release(lease.handle)  # the lease ends while its READ is pinned
            regions.append(stage_arena_lease(producer, (3, 4))[0].region)
        with pytest.raises(PullFailed, match="did not confirm"):
            direct_pull(context, reader, source, [0, 1], [0, 1], before_read=end_then_stage_another)
        assert regions[0].offset != lease.region.offset, "a pinned region was handed to another lease"
        assert_pulled(producer, consumer, (1, 2), (0, 1))  # what the READ saw was still the old lease


def test_a_read_after_the_lease_ended_fails_the_pull(context, reader_of):
    """The producer cannot refuse a one-sided READ, so it refuses to confirm it."""
    consumer = make_cache(torch.bfloat16, "block-dim-0", CONSUMER_BLOCKS, seed=None)
    reader = reader_of(consumer)
    with Producer(torch.bfloat16, "block-dim-0").serving() as producer:
        lease, source = stage_arena_lease(producer, (1, 2))
        with pytest.raises(PullFailed, match="did not confirm"):
            direct_pull(context, reader, source, [0, 1], [0, 1],
                        before_read=lambda ref: producer.leases.release(lease.handle))


def test_bytes_changed_under_a_read_fail_their_checksum(context, reader_of):
    consumer = make_cache(torch.bfloat16, "block-dim-1", CONSUMER_BLOCKS, seed=None)
    reader = reader_of(consumer)
    with Producer(torch.bfloat16, "block-dim-1").serving() as producer:
        lease, source = stage_arena_lease(producer, (1, 2))

        def corrupt(ref):
            producer.leases.get(lease.handle).staged[1][100] ^= 0x01
        with pytest.raises(CorruptFrame, match="layer 1"):
            direct_pull(context, reader, source, [0, 1], [0, 1], checksum=True, before_read=corrupt)


def _serve_in_child(queue) -> None:
    """A producer in a process of its own, as a prefill worker's is."""
    from foundation import zmq_auth
    zmq_auth.configure_from_environment("worker")
    with Producer(torch.bfloat16, "block-dim-0").serving() as producer:
        _, source = stage_arena_lease(producer, (1, 2, 3))
        queue.put(source)
        time.sleep(50)  # until killed


def test_a_killed_producer_fails_the_pull_by_its_deadline(context, reader_of):
    consumer = make_cache(torch.bfloat16, "block-dim-0", CONSUMER_BLOCKS, seed=None)
    reader = reader_of(consumer)
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    child = spawn.Process(target=_serve_in_child, args=(queue,))
    child.start()
    try:
        source = queue.get(timeout=50)

        def kill(ref):
            os.kill(child.pid, signal.SIGKILL)
            child.join(10)
        with pytest.raises(PullFailed):
            direct_pull(context, reader, source, [0, 1, 2], [0, 1, 2], before_read=kill, deadline_seconds=3.0)
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)


def test_the_connector_reads_directly_with_a_nixl_link_and_scatters_nothing():
    worker, cache = consumer_connector("nixl")
    try:
        with Producer(torch.bfloat16, "block-dim-0").serving() as producer:
            _, staged = stage_arena_lease(producer, (3, 7, 1))
            _, in_place = producer.lease((2, 4))  # not staged: the producer sends frames
            finished, failed = run_loads(worker, [LoadSpec("staged", staged, (0, 1, 2), (8, 0, 5)),
                                                  LoadSpec("in-place", in_place, (0, 1), (1, 2))])
            assert finished == {"staged", "in-place"} and not failed
            assert_pulled(producer, cache, (3, 7, 1, 2, 4), (8, 0, 5, 1, 2))
            counters = worker.counters.snapshot()
            assert counters.direct_pulls == 1 and counters.pulls_ok == 2
            assert counters.bytes_scattered == 2 * cache.spec.bytes_per_block  # the in-place lease's frames only
    finally:
        worker.shutdown()


@pytest.mark.parametrize("link", ["nixl", "auto", "endpoint"])
def test_a_producer_connector_stages_into_the_arena_and_offers_direct_reads_only_when_it_hosts_nixl(
        context, reader_of, link):
    address = tcp("127.0.0.1", free_port())
    settings = ConnectorSettings(transfer_address=address, transfer_bind=address, idle_spin_seconds=-1.0,
                                 transfer_link=link)
    worker = ConnectorWorker(settings, PRODUCER_BLOCKS, BLOCK_SIZE)
    producer_cache = make_cache(torch.bfloat16, "block-dim-1", PRODUCER_BLOCKS, seed=99)
    expected = make_cache(torch.bfloat16, "block-dim-1", PRODUCER_BLOCKS, seed=99)  # what the engine computed
    worker.register({f"model.layers.{index}.attn": layer for index, layer in enumerate(producer_cache.layers)})
    consumer = make_cache(torch.bfloat16, "block-dim-1", CONSUMER_BLOCKS, seed=None)
    try:
        worker.start(KVRouteConnectorMetadata(grants=[LeaseGrant("request", "handle", (6, 2, 9), 3 * BLOCK_SIZE)]))
        lease = worker.leases.get("handle")
        hosts_nixl = link in ("nixl", "auto")  # auto hosts nixl to measure it
        assert lease.staged is not None and lease.region is not None  # every producer stages into its arena
        for layer in producer_cache.layers:
            layer.zero_()  # the engine reuses the freed blocks: the lease must not care
        source = PullSource(handle="handle", address=address, num_tokens=3 * BLOCK_SIZE, block_size=BLOCK_SIZE)
        direct_pull(context, reader_of(consumer), source, [0, 1, 2], [0, 4, 3], expect_direct=hosts_nixl)
        for layer in range(len(consumer.layers)):
            for remote, local in ((6, 0), (2, 4), (9, 3)):
                assert torch.equal(block_bytes(consumer, layer, local), block_bytes(expected, layer, remote))
    finally:
        worker.shutdown()
