"""Pooled channels to a transfer endpoint: one connection serves pull after pull, and a
channel whose exchange failed is closed, so no frame of an abandoned pull reaches the next."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from foundation.endpoint_client import ChannelPool, PullFailed, release_lease
from tests.contract.transfer_endpoint import DEADLINE_SECONDS, Producer, assert_pulled
from tests.paged_caches import CONSUMER_BLOCKS, PRODUCER_BLOCKS, make_cache
from transfer.block_client import pull_blocks
from transfer.kv_layout import block_index_tensor

pytestmark = pytest.mark.timeout(60)

DTYPE, LAYOUT = torch.float32, "block-dim-0"


@pytest.fixture
def producer():
    with Producer(DTYPE, LAYOUT).serving() as producer:
        yield producer


@pytest.fixture
def pool(context):
    pool = ChannelPool(context)
    yield pool
    pool.close()


def pooled_pull(pool, source, indices, consumer, local_ids, on_layer=None) -> int:
    local = block_index_tensor(local_ids)
    store = on_layer or (lambda layer, data: consumer.scatter_layer(layer, local, data))
    return pull_blocks(pool.context, source, indices, consumer.spec, store,
                       time.monotonic() + DEADLINE_SECONDS, channels=pool)


def test_pulls_and_releases_reuse_one_channel(producer, pool):
    lease_blocks = (2, 5, 9)
    _, source = producer.lease(lease_blocks)
    for _ in range(3):
        consumer = make_cache(DTYPE, LAYOUT, CONSUMER_BLOCKS, seed=None)
        pooled_pull(pool, source, [0, 1, 2], consumer, [0, 1, 2])
        assert_pulled(producer, consumer, lease_blocks, [0, 1, 2])
        assert pool.idle_channels(producer.address) == 1
    assert release_lease(pool.context, producer.address, source.handle, "ack", channels=pool)
    assert pool.idle_channels(producer.address) == 1
    assert len(producer.leases) == 0


def test_a_pull_abandoned_mid_transfer_closes_its_channel_and_the_next_pull_is_exact(producer, pool):
    """The consumer gives up after the first layer: the other layers are still on the way.
    Reusing that socket would hand them to the next pull as its own."""
    _, abandoned = producer.lease((1, 3, 5, 7))
    consumer = make_cache(DTYPE, LAYOUT, CONSUMER_BLOCKS, seed=None)

    def fail(layer, data):
        raise RuntimeError("scatter failed")

    with pytest.raises(RuntimeError, match="scatter failed"):
        pooled_pull(pool, abandoned, [0, 1, 2, 3], consumer, [0, 1, 2, 3], on_layer=fail)
    assert pool.idle_channels(producer.address) == 0

    lease_blocks = (10, 0, 4, 8)  # other blocks, other bytes: a stale frame would show
    _, source = producer.lease(lease_blocks)
    pooled_pull(pool, source, [0, 1, 2, 3], consumer, [0, 1, 2, 3])
    assert_pulled(producer, consumer, lease_blocks, [0, 1, 2, 3])
    assert pool.idle_channels(producer.address) == 1


def test_a_refused_pull_closes_its_channel(producer, pool):
    consumer = make_cache(DTYPE, LAYOUT, CONSUMER_BLOCKS, seed=None)
    with pytest.raises(PullFailed, match="refused"):
        pooled_pull(pool, producer.source("0" * 32), [0], consumer, [0])
    assert pool.idle_channels(producer.address) == 0


def test_concurrent_pulls_through_one_pool(producer, pool):
    leases = [producer.lease((i, (i + 3) % PRODUCER_BLOCKS, (i + 7) % PRODUCER_BLOCKS)) for i in range(4)]
    errors: list[BaseException] = []

    def pull_repeatedly(lease_blocks, source):
        try:
            for _ in range(5):
                consumer = make_cache(DTYPE, LAYOUT, CONSUMER_BLOCKS, seed=None)
                pooled_pull(pool, source, [0, 1, 2], consumer, [4, 5, 6])
                assert_pulled(producer, consumer, lease_blocks, [4, 5, 6])
        except BaseException as error:  # reported on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=pull_repeatedly, args=(lease.block_ids, source)) for lease, source in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert 1 <= pool.idle_channels(producer.address) <= pool.idle_per_address


def test_a_closed_pool_still_pulls_but_keeps_nothing(producer, pool):
    lease_blocks = (6, 2)
    _, source = producer.lease(lease_blocks)
    pool.close()
    consumer = make_cache(DTYPE, LAYOUT, CONSUMER_BLOCKS, seed=None)
    pooled_pull(pool, source, [0, 1], consumer, [0, 1])
    assert_pulled(producer, consumer, lease_blocks, [0, 1])
    assert pool.idle_channels(producer.address) == 0
