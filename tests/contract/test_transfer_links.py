"""Pulls whose layers travel over a transport link (``transfer.link_control``), against a
real BlockServer: each backend that runs here (zmq-tcp, zmq-ipc, Gloo, NIXL) moves delta and
staged pulls bit-exactly, a link is opened once per pair and reused, and a failed or
refused pull closes it so the next pull opens a new one."""

from __future__ import annotations

import time

import pytest
import torch

from foundation.endpoint_client import PullFailed, fetch_transfer_stats
from tests.contract.transfer_endpoint import DEADLINE_SECONDS, PARK_SECONDS, Producer, assert_pulled, stage
from tests.paged_caches import CONSUMER_BLOCKS, NUM_LAYERS, block_bytes, make_cache
from transfer.kv_layout import PagedKVCache, block_index_tensor
from transfer.link_control import ConsumerLink, open_consumer_link, pull_over_link
from transfer.transports.nixl_agent import nixl_missing
from transfer.transports.settings import TransportSettings

pytestmark = pytest.mark.timeout(90)

BACKENDS = ["zmq-tcp", "zmq-ipc", "gloo",
            pytest.param("nixl", marks=pytest.mark.skipif(bool(nixl_missing()), reason="nixl_cu12 is not installed"))]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def producer(backend):
    with Producer(torch.bfloat16, "block-dim-1", TransportSettings(backend=backend)).serving() as producer:
        yield producer


@pytest.fixture
def consumer():
    return make_cache(torch.bfloat16, "block-dim-1", CONSUMER_BLOCKS, seed=None)


@pytest.fixture
def link(context, producer, consumer, backend):
    link = open_consumer_link(context, producer.address, consumer.spec, torch.device("cpu"),
                              TransportSettings(backend=backend))
    yield link
    link.close()


def pull(context, link: ConsumerLink, consumer: PagedKVCache, source, indices, local_ids) -> int:
    local = block_index_tensor(local_ids)
    return pull_over_link(context, source, indices, consumer.spec, link,
                          lambda layer, data: consumer.scatter_layer(layer, local, data),
                          time.monotonic() + DEADLINE_SECONDS)


def test_a_delta_pull_over_the_link_is_bit_exact_and_writes_only_its_blocks(context, producer, consumer, link,
                                                                          backend):
    assert link.receiver.backend == backend
    _, source = producer.lease((2, 5, 7, 9))
    received = pull(context, link, consumer, source, [1, 3], [4, 0])
    assert received == 2 * consumer.spec.bytes_per_block
    assert_pulled(producer, consumer, [5, 9], [4, 0])
    counters = fetch_transfer_stats(context, producer.address).counters
    assert counters.bytes_sent == received and counters.blocks_sent == 2


def test_one_link_carries_every_pull_of_the_pair(context, producer, consumer, link):
    for remote, local in (((1, 2), (0, 1)), ((3,), (5,)), ((10, 11, 0), (7, 8, 9))):
        _, source = producer.lease(remote)
        pull(context, link, consumer, source, list(range(len(remote))), list(local))
        for layer in range(NUM_LAYERS):
            for remote_id, local_id in zip(remote, local):
                expected = block_bytes(producer.cache, layer, remote_id)
                assert torch.equal(block_bytes(consumer, layer, local_id), expected)
    assert not link.closed and fetch_transfer_stats(context, producer.address).counters.links_opened == 1


@pytest.mark.parametrize("positions, local_ids", [([3, 0], [2, 6]),  # gathered from the copy
                                                  ([0, 1, 2, 3], [2, 6, 9, 4])])  # the whole copy, as it lies
def test_a_staged_lease_is_sent_from_its_copy(context, producer, consumer, link, positions, local_ids):
    lease_blocks = (3, 7, 1, 10)
    lease, source = producer.lease(lease_blocks, grant=False)
    producer.leases.grant(lease, staging_bytes=len(lease_blocks) * producer.cache.spec.bytes_per_block)
    original = stage(producer, lease)
    pull(context, link, consumer, source, positions, local_ids)
    for layer in range(NUM_LAYERS):
        for position, local_id in zip(positions, local_ids):
            expected = original[layer].select(producer.cache.block_dim, lease_blocks[position]).contiguous()
            assert torch.equal(block_bytes(consumer, layer, local_id), expected.view(torch.uint8))


def test_a_refused_pull_closes_the_link_and_a_new_one_serves_the_next(context, producer, consumer, link, backend):
    with pytest.raises(PullFailed, match="unknown or expired handle"):
        pull(context, link, consumer, producer.source("00" * 16), [0], [0])
    assert link.closed
    fresh = open_consumer_link(context, producer.address, consumer.spec, torch.device("cpu"),
                               TransportSettings(backend=backend))
    try:
        _, source = producer.lease((4,))
        pull(context, fresh, consumer, source, [0], [3])
        assert_pulled(producer, consumer, [4], [3])
    finally:
        fresh.close()


def test_a_link_the_producer_does_not_know_is_refused(context, producer, consumer, link):
    _, first = producer.lease((2,))
    pull(context, link, consumer, first, [0], [5])  # the server has registered the link by now
    producer.server._links.clear()  # as after the producer restarted
    _, source = producer.lease((1,))
    with pytest.raises(PullFailed, match="unknown or closed link"):
        pull(context, link, consumer, source, [0], [0])
    assert link.closed
    assert not block_bytes(consumer, 0, 0).any()


def test_a_layout_mismatch_refuses_the_link_before_any_byte_moves(context, producer):
    other = make_cache(torch.float32, "block-dim-1", CONSUMER_BLOCKS, seed=None)
    with pytest.raises(PullFailed, match="could not open"):
        open_consumer_link(context, producer.address, other.spec, torch.device("cpu"),
                           TransportSettings(backend="zmq-tcp"), timeout=3 * PARK_SECONDS)
    assert producer.server._links == {}
    assert fetch_transfer_stats(context, producer.address).counters.bytes_sent == 0
