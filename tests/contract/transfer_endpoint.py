"""A producer's transfer endpoint for the contract tests: a real BlockServer on 127.0.0.1 serving
a fake paged cache (``tests.paged_caches``), its leases, and pulls driven through block_client
as a consumer engine drives them."""

from __future__ import annotations

import contextlib
import secrets
import time

import msgspec
import torch

from foundation import wire
from foundation.netutil import free_port, tcp
from tests.paged_caches import (
    BLOCK_SIZE,
    CONSUMER_BLOCKS,
    NUM_LAYERS,
    PRODUCER_BLOCKS,
    block_bytes,
    make_cache,
    snapshot,
)
from transfer.block_client import pull_blocks
from transfer.block_server import BlockServer
from transfer.connector_worker import ConnectorWorker
from transfer.counters import Counters
from transfer.kv_layout import PagedKVCache, block_index_tensor
from transfer.leases import Lease, LeaseTable
from transfer.metadata import KVRouteConnectorMetadata, LoadSpec
from transfer.settings import ConnectorSettings
from transfer.shared_copies import stage_shared
from transfer.staging_arena import stage_in_arena, staging_arena
from transfer.transports.settings import TransportSettings

PARK_SECONDS = 0.5
DEADLINE_SECONDS = 5.0


class Producer:
    """A BlockServer on 127.0.0.1 over a random producer cache, with its lease table and counters."""

    def __init__(self, dtype: torch.dtype, layout: str, link_settings: TransportSettings | None = None,
                 max_parked: int = 64, server_class: type[BlockServer] = BlockServer):
        """``server_class``: a BlockServer subclass that misbehaves on purpose, for the
        consumer's integrity tests."""
        self.cache = make_cache(dtype, layout, PRODUCER_BLOCKS, seed=1234)
        self.leases = LeaseTable()
        self.counters = Counters()
        self.address = tcp("127.0.0.1", free_port())
        self.server = server_class(self.address, self.cache, self.leases, self.counters,
                                   park_seconds=PARK_SECONDS, link_settings=link_settings, max_parked=max_parked)

    @contextlib.contextmanager
    def serving(self):
        self.server.start()
        try:
            yield self
        finally:
            self.server.stop()
            self.leases.release_all()  # as the process's end would: staged memory goes back

    def lease(self, block_ids, request_id: str | None = None, grant: bool = True) -> tuple[Lease, wire.PullSource]:
        handle = secrets.token_hex(16)
        lease = Lease(handle=handle, request_id=request_id or f"req-{handle[:6]}", block_ids=tuple(block_ids),
                      num_tokens=len(block_ids) * BLOCK_SIZE, expires_at=time.monotonic() + 60)
        if grant:
            self.leases.grant(lease)
        return lease, self.source(handle, lease.num_tokens)

    def source(self, handle: str, num_tokens: int = BLOCK_SIZE) -> wire.PullSource:
        return wire.PullSource(handle=handle, address=self.address, num_tokens=num_tokens, block_size=BLOCK_SIZE)


def pull_into(context, consumer: PagedKVCache, source: wire.PullSource, indices, local_ids,
              layout: wire.KVLayoutSpec | None = None, deadline_seconds: float = DEADLINE_SECONDS,
              checksum: bool = False) -> int:
    local = block_index_tensor(local_ids)
    return pull_blocks(context, source, indices, layout or consumer.spec,
                       lambda layer, data: consumer.scatter_layer(layer, local, data),
                       time.monotonic() + deadline_seconds, checksum=checksum)


def assert_pulled(producer: Producer, consumer: PagedKVCache, remote_ids, local_ids) -> None:
    for layer in range(NUM_LAYERS):
        for remote_id, local_id in zip(remote_ids, local_ids):
            assert torch.equal(block_bytes(consumer, layer, local_id), block_bytes(producer.cache, layer, remote_id)), \
                (layer, remote_id, local_id)
        for block_id in set(range(CONSUMER_BLOCKS)) - set(local_ids):
            assert not block_bytes(consumer, layer, block_id).any(), (layer, block_id)


def assert_untouched(consumer: PagedKVCache) -> None:
    assert all(not layer.any() for layer in consumer.layers)


def stage_shared_lease(producer: Producer, block_ids) -> tuple[Lease, wire.PullSource]:
    """A lease staged in shared memory, as the producer's connector stages it."""
    lease, source = producer.lease(block_ids, grant=False)
    producer.leases.grant(lease, staging_bytes=len(block_ids) * producer.cache.spec.bytes_per_block)
    layers, shared = stage_shared(producer.cache, block_index_tensor(block_ids))
    producer.leases.finish_staging(lease.handle, layers, shared)
    return lease, source


def stage_arena_lease(producer: Producer, block_ids) -> tuple[Lease, wire.PullSource]:
    """A lease staged in the process's staging arena, as a producer hosting nixl stages it (the
    lease as staged: its region is set)."""
    lease, source = producer.lease(block_ids, grant=False)
    nbytes = len(block_ids) * producer.cache.spec.bytes_per_block
    producer.leases.grant(lease, staging_bytes=nbytes)
    layers, region = stage_in_arena(producer.cache, block_index_tensor(block_ids), staging_arena(ARENA_BYTES))
    producer.leases.finish_staging(lease.handle, layers, region=region)
    return producer.leases.get(lease.handle), source


ARENA_BYTES = 64 << 20  # every test producer's leases fit, so each test finds the same arena


def stage(producer: Producer, lease: Lease) -> list[torch.Tensor]:
    """What the producer's staging thread does, then the engine reusing the freed blocks.

    Returns the producer's layers as they were, to compare the pulled blocks against."""
    original = snapshot(producer.cache)
    producer.leases.finish_staging(lease.handle, producer.cache.copy_blocks(block_index_tensor(lease.block_ids)))
    assert producer.leases.take_ended_request_ids() == {lease.request_id}  # the engine may free them
    for layer in producer.cache.layers:
        layer.view(torch.uint8).fill_(0xA5)  # freed blocks get new owners: the lease must not care
    return original


def lying(**fields) -> type[BlockServer]:
    """A block server whose every accepting header misstates ``fields``; what follows it is
    what the honest server sends."""

    class LyingServer(BlockServer):
        def _accepted(self, request, shared_copy=None, direct=None) -> wire.PullHeader:
            return msgspec.structs.replace(super()._accepted(request, shared_copy, direct), **fields)

    return LyingServer


def consumer_connector(transfer_link: str) -> tuple[ConnectorWorker, PagedKVCache]:
    """A decode worker's connector (its worker half) with ``transfer_link``, over a zeroed cache
    it registered as vLLM registers one; the caller shuts it down."""
    settings = ConnectorSettings(transfer_address="tcp://127.0.0.1:0", idle_spin_seconds=-1.0,
                                 pull_timeout_seconds=5.0, transfer_link=transfer_link)
    worker = ConnectorWorker(settings, CONSUMER_BLOCKS, BLOCK_SIZE)
    cache = make_cache(torch.bfloat16, "block-dim-0", CONSUMER_BLOCKS, seed=None)
    worker.register({f"model.layers.{index}.attn": layer for index, layer in enumerate(cache.layers)})
    return worker, cache


def run_loads(worker: ConnectorWorker, loads: list[LoadSpec], seconds: float = 10.0) -> tuple[set[str], set[str]]:
    """Start ``loads`` as vLLM's step would and wait until each reported: (finished, failed)."""
    worker.start(KVRouteConnectorMetadata(loads=loads))
    finished: set[str] = set()
    failed: set[str] = set()
    give_up_at = time.monotonic() + seconds
    while len(finished) < len(loads) and time.monotonic() < give_up_at:
        _, done, bad = worker.take_results()
        finished |= done
        failed |= bad
        time.sleep(0.01)
    return finished, failed
