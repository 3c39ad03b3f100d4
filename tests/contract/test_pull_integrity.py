"""Integrity of moved KV: a consumer's connector pulling from a real BlockServer over real
sockets refuses a producer whose header disagrees with the pull before it writes anything,
and a frame that fails its checksum before that frame is stored. Either way the load is
reported failed, which vLLM (``kv_load_failure_policy="recompute"``) answers by computing
the prompt itself.

The producers here are BlockServer subclasses that lie on purpose; the consumer is the
connector's own worker half (``ConnectorWorker``) over a CPU cache.
"""

from __future__ import annotations

import time

import pytest
import torch

from foundation import wire
from tests.contract.transfer_endpoint import Producer, lying, pull_into, stage_shared_lease
from tests.paged_caches import BLOCK_SIZE, CONSUMER_BLOCKS, NUM_LAYERS, block_bytes, make_cache, snapshot
from transfer.block_server import BlockServer
from transfer.connector_worker import ConnectorWorker
from transfer.metadata import KVRouteConnectorMetadata, LoadSpec
from transfer.pull_check import CorruptFrame, PullRefused
from transfer.settings import ConnectorSettings

pytestmark = pytest.mark.timeout(60)

LEASE_BLOCKS = (3, 7, 1)
LOCAL_IDS = (8, 0, 5)
RESULT_SECONDS = 10.0


class CorruptingServer(BlockServer):
    """Changes a byte of layer 1's frame after its digest was made, as a faulty wire or a
    send buffer rewritten in flight would."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.frames_prefixed = 0

    def _prefix(self, identity: bytes, frame: torch.Tensor, checksum: bool) -> list[bytes]:
        prefix = super()._prefix(identity, frame, checksum)
        self.frames_prefixed += 1
        if self.frames_prefixed == 2:
            frame[len(frame) // 2] ^= 0x01
        return prefix


@pytest.fixture
def consumer():
    """The consumer's connector (worker half) over a zeroed bfloat16 cache."""
    settings = ConnectorSettings(transfer_address="tcp://127.0.0.1:0", idle_spin_seconds=-1.0,
                                 pull_timeout_seconds=5.0, transfer_checksum=True)
    worker = ConnectorWorker(settings, CONSUMER_BLOCKS, BLOCK_SIZE)
    cache = make_cache(torch.bfloat16, "block-dim-0", CONSUMER_BLOCKS, seed=None)
    worker.register({f"model.layers.{index}.attn": layer for index, layer in enumerate(cache.layers)})
    yield worker
    worker.shutdown()


def load_through(worker: ConnectorWorker, source: wire.PullSource, request_id: str = "req-1") -> tuple[set, set]:
    """Start one load as vLLM's step would, and wait for its result: (finished, failed)."""
    worker.start(KVRouteConnectorMetadata(loads=[LoadSpec(request_id, source, tuple(range(len(LEASE_BLOCKS))),
                                                          LOCAL_IDS)]))
    give_up_at = time.monotonic() + RESULT_SECONDS
    while time.monotonic() < give_up_at:
        _, finished, failed = worker.take_results()
        if finished:
            return finished, failed
        time.sleep(0.01)
    raise AssertionError("the load never finished")


def serve_lease(producer: Producer, shared: bool) -> wire.PullSource:
    if shared:
        return stage_shared_lease(producer, LEASE_BLOCKS)[1]
    return producer.lease(LEASE_BLOCKS)[1]


def assert_pulled(producer: Producer, worker: ConnectorWorker) -> None:
    for layer in range(NUM_LAYERS):
        for remote_id, local_id in zip(LEASE_BLOCKS, LOCAL_IDS):
            pulled = block_bytes(worker.cache, layer, local_id)
            assert torch.equal(pulled, block_bytes(producer.cache, layer, remote_id)), (layer, remote_id)


LIES = {
    "no layers": {"num_layers": 0},
    "one layer too many": {"num_layers": NUM_LAYERS + 1},
    "fewer blocks": {"num_blocks": 2},
    "other positions": {"block_indices": [0, 2, 1]},
    "longer frames": {"frame_bytes": 1 << 20},
    "no checksums": {"checksum": False},
    "no layout": {"layout": None},
    "other dtype": {"layout": wire.KVLayoutSpec(dtype="float16", num_layers=NUM_LAYERS, block_dim=0,
                                                block_shape=[2, 4, BLOCK_SIZE, 32], block_size=BLOCK_SIZE,
                                                bytes_per_block=NUM_LAYERS * 2 * 4 * BLOCK_SIZE * 32 * 2)},
}


@pytest.mark.parametrize("shared", [False, True], ids=["frames", "shared-copy"])
@pytest.mark.parametrize("lie", list(LIES))
def test_a_header_that_disagrees_is_refused_before_anything_is_written(consumer, lie, shared):
    if shared and lie == "no checksums":
        pytest.skip("a shared copy carries no checksums: there is nothing to misstate")
    with Producer(torch.bfloat16, "block-dim-0", server_class=lying(**LIES[lie])).serving() as producer:
        source = serve_lease(producer, shared)
        finished, failed = load_through(consumer, source)

    assert finished == failed == {"req-1"}  # reported to vLLM as a failed load: it recomputes
    assert all(not layer.any() for layer in consumer.cache.layers), "the refused pull wrote into the cache"
    counters = consumer.counters.snapshot()
    assert (counters.pulls_failed, counters.pulls_refused, counters.pulls_ok) == (1, 1, 0)


def test_the_refusal_names_every_misstated_field(context):
    consumer = make_cache(torch.bfloat16, "block-dim-0", CONSUMER_BLOCKS, seed=None)
    with Producer(torch.bfloat16, "block-dim-0", server_class=lying(num_layers=0, frame_bytes=7)).serving() as p:
        _, source = p.lease(LEASE_BLOCKS)
        with pytest.raises(PullRefused, match=f"layers 0, expected {NUM_LAYERS}; frame bytes 7, expected"):
            pull_into(context, consumer, source, [0, 1, 2], list(LOCAL_IDS))


@pytest.mark.parametrize("staged", [False, True], ids=["gathered", "staged"])
def test_a_frame_that_fails_its_checksum_is_never_stored(consumer, staged):
    with Producer(torch.bfloat16, "block-dim-0", server_class=CorruptingServer).serving() as producer:
        lease, source = producer.lease(LEASE_BLOCKS, grant=not staged)
        if staged:  # staged privately: sent as frames from the copy, not read from shared memory
            producer.leases.grant(lease, staging_bytes=len(LEASE_BLOCKS) * producer.cache.spec.bytes_per_block)
            producer.leases.finish_staging(lease.handle, producer.cache.copy_blocks(torch.tensor(LEASE_BLOCKS)))
        finished, failed = load_through(consumer, source)

    assert finished == failed == {"req-1"}
    assert consumer.cache.layers[0].any(), "layer 0 passed its checksum and was stored"
    assert all(not layer.any() for layer in consumer.cache.layers[1:]), "a corrupt frame reached the cache"
    counters = consumer.counters.snapshot()
    assert (counters.pulls_failed, counters.checksum_failures, counters.pulls_refused) == (1, 1, 0)


def test_checksummed_pulls_from_an_honest_producer_are_bit_exact(consumer):
    with Producer(torch.bfloat16, "block-dim-0").serving() as producer:
        finished, failed = load_through(consumer, producer.lease(LEASE_BLOCKS)[1])
        assert (finished, failed) == ({"req-1"}, set())
        assert_pulled(producer, consumer)


def test_a_corrupt_frame_is_named_by_the_client(context):
    consumer = make_cache(torch.bfloat16, "block-dim-0", CONSUMER_BLOCKS, seed=None)
    before = snapshot(consumer)
    with Producer(torch.bfloat16, "block-dim-0", server_class=CorruptingServer).serving() as producer:
        _, source = producer.lease(LEASE_BLOCKS)
        with pytest.raises(CorruptFrame, match="frame 1: its bytes do not match"):
            pull_into(context, consumer, source, [0, 1, 2], list(LOCAL_IDS), checksum=True)
    assert all(torch.equal(now, then) for now, then in zip(consumer.layers[1:], before[1:]))


@pytest.fixture
def link_consumer():
    """As ``consumer``, with the layers over a zmq-tcp link instead of the endpoint's connection."""
    settings = ConnectorSettings(transfer_address="tcp://127.0.0.1:0", idle_spin_seconds=-1.0,
                                 pull_timeout_seconds=5.0, transfer_checksum=True, transfer_link="zmq-tcp")
    worker = ConnectorWorker(settings, CONSUMER_BLOCKS, BLOCK_SIZE)
    cache = make_cache(torch.bfloat16, "block-dim-0", CONSUMER_BLOCKS, seed=None)
    worker.register({f"model.layers.{index}.attn": layer for index, layer in enumerate(cache.layers)})
    yield worker
    worker.shutdown()


def test_over_a_link_checksummed_pulls_are_exact_and_a_lying_header_is_refused(link_consumer):
    with Producer(torch.bfloat16, "block-dim-0").serving() as producer:
        assert load_through(link_consumer, producer.lease(LEASE_BLOCKS)[1], "req-ok") == ({"req-ok"}, set())
        assert_pulled(producer, link_consumer)
    for layer in link_consumer.cache.layers:
        layer.zero_()
    with Producer(torch.bfloat16, "block-dim-0", server_class=lying(num_layers=0)).serving() as producer:
        assert load_through(link_consumer, producer.lease(LEASE_BLOCKS)[1], "req-lie") == ({"req-lie"}, {"req-lie"})
    assert all(not layer.any() for layer in link_consumer.cache.layers)
    assert link_consumer.counters.snapshot().pulls_refused == 1
