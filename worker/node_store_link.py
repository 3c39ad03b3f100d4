"""A worker's dealings with its host's node store (``transfer.node_store``) outside the
engine: the store's counters in the worker's stats, emptying it with the engine's cache
on reset-cache, and passing its events on to the orchestrators' indexes (which have no
line to the store). The engine's connector does the lookups, loads and write-throughs.

Several workers on one host share a store: each reports it and each reset empties it (the
orchestrator groups them by store, ``orchestrator.node_stores``). A store that does not answer
costs the call a short wait and an error string, never the worker's stats or its reset.
"""

from __future__ import annotations

import asyncio

from foundation import wire
from transfer.node_store.client import NodeStoreClient, StoreRefused, StoreUnavailable

STATS_TIMEOUT_SECONDS = 1.0
EVENTS_TIMEOUT_SECONDS = 2.0  # a snapshot of a large store takes a while to encode


class NodeStoreLink:
    """``address``: the store's; empty for a worker without one, whose stats and resets then
    carry no store fields."""

    def __init__(self, address: str):
        self.address = address
        self._client = NodeStoreClient(address) if address else None

    async def stats_fields(self) -> dict:
        """The ``WorkerStats`` fields that describe the store: its counters, or why it did not answer."""
        if self._client is None:
            return {}
        try:
            reply = await asyncio.to_thread(self._client.stats, STATS_TIMEOUT_SECONDS)
        except (StoreUnavailable, StoreRefused) as error:
            return {"node_store_address": self.address, "node_store_error": str(error)}
        return {"node_store_address": self.address, "node_store": reply.counters}

    async def events(self, request: wire.TierEventsRequest) -> wire.TierEventsReply:
        """The store's events after ``request.since`` (or its snapshot), for an orchestrator."""
        if self._client is None:
            raise StoreUnavailable("this worker has no node store")
        reply = await asyncio.to_thread(self._client.events, request.since, request.epoch, EVENTS_TIMEOUT_SECONDS)
        reply.request_id = request.request_id
        return reply

    async def reset_fields(self) -> dict:
        """Empty the store; the ``ResetCacheReply`` fields that say how that went."""
        if self._client is None:
            return {}
        try:
            reply = await asyncio.to_thread(self._client.reset)
        except (StoreUnavailable, StoreRefused) as error:
            return {"store_error": str(error)}
        return {"store_blocks_dropped": reply.blocks_dropped}
