"""A worker's dealings with its host's node store (``transfer.node_store``) outside the
engine: the store's counters in the worker's stats, and emptying it with the engine's cache
on reset-cache. The engine's connector does the lookups, loads and write-throughs.

Several workers on one host share a store: each reports it and each reset empties it (the
orchestrator groups them by store, ``orchestrator.admin``). A store that does not answer
costs the call a short wait and an error string, never the worker's stats or its reset.
"""

from __future__ import annotations

import asyncio

from foundation import wire
from transfer.node_store.client import NodeStoreClient, StoreRefused, StoreUnavailable

STATS_TIMEOUT_SECONDS = 1.0


class NodeStoreLink:
    def __init__(self, address: str):
        self.address = address
        self._client = NodeStoreClient(address)

    async def counters(self) -> tuple[wire.TierCounters | None, str]:
        """(the store's counters, "") or (None, why it did not answer)."""
        try:
            reply = await asyncio.to_thread(self._client.stats, STATS_TIMEOUT_SECONDS)
        except (StoreUnavailable, StoreRefused) as error:
            return None, str(error)
        return reply.counters, ""

    async def reset(self) -> tuple[int, str]:
        """(the blocks the store dropped, "") or (0, why it could not be emptied)."""
        try:
            reply = await asyncio.to_thread(self._client.reset)
        except (StoreUnavailable, StoreRefused) as error:
            return 0, str(error)
        return reply.blocks_dropped, ""

    async def stats_fields(self) -> dict:
        """The ``WorkerStats`` fields that describe the store."""
        counters, error = await self.counters()
        return {"node_store_address": self.address, "node_store": counters, "node_store_error": error}

    async def reset_fields(self) -> dict:
        """The ``ResetCacheReply`` fields that describe the store's reset."""
        dropped, error = await self.reset()
        return {"store_blocks_dropped": dropped, "store_error": error}

    def close(self) -> None:
        self._client.close()
