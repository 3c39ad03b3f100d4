"""Keeping ``TierHoldings`` in step with every node KV store the fleet's workers use.

The orchestrator has no line to a store (it listens on its host's loopback), so it reads a
store's events through the workers that use it, one task per store::

    every poll: ask a worker on the store for its events after the last applied
        ─▶ apply them (or the snapshot the store sent instead, after a gap or a restart)
        ─▶ no worker on it answers ─▶ forget the store: nothing is priced as held there

Polling, not a subscription: blocks enter a store when a request ends, and the next
request that could load them arrives after its client has read the answer, so a quarter
of a second behind costs little; and every poll is also a liveness check of the store.
"""

from __future__ import annotations

import asyncio
import logging

from orchestrator.registry import WorkerView
from orchestrator.tier_holdings import StoreKey, TierHoldings
from orchestrator.worker_client import WorkerClient, WorkerError

logger = logging.getLogger("kvroute.orchestrator.tier_sync")

DEFAULT_POLL_SECONDS = 0.25
EVENTS_TIMEOUT_SECONDS = 5.0


class TierSync:
    """A fleet listener: one following task per store while a live worker uses it."""

    def __init__(self, holdings: TierHoldings, poll_seconds: float = DEFAULT_POLL_SECONDS):
        self.holdings = holdings
        self.poll_seconds = poll_seconds
        self._store_of: dict[str, StoreKey] = {}
        self._clients: dict[StoreKey, dict[str, WorkerClient]] = {}
        self._tasks: dict[StoreKey, asyncio.Task] = {}
        self.errors: dict[StoreKey, str] = {}  # why a store is not followed now

    def worker_up(self, worker: WorkerView, client: WorkerClient) -> None:
        self.worker_down(worker.worker_id)
        store = worker.node_store
        if store is None:
            return
        self._store_of[worker.worker_id] = store
        self._clients.setdefault(store, {})[worker.worker_id] = client
        if store not in self._tasks:
            self._tasks[store] = asyncio.create_task(self._follow(store))

    def worker_down(self, worker_id: str) -> None:
        store = self._store_of.pop(worker_id, None)
        if store is None:
            return
        clients = self._clients[store]
        clients.pop(worker_id, None)
        if not clients:  # the last worker on it: the store is out of reach
            del self._clients[store]
            self._tasks.pop(store).cancel()
            self.holdings.forget(store)
            self.errors.pop(store, None)

    def worker_left(self, worker_id: str) -> None:
        pass

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    async def poll(self, store: StoreKey) -> bool:
        """One round for ``store``: its events through the first of its workers that answers."""
        problems = []
        for worker_id, client in list(self._clients.get(store, {}).items()):
            epoch, seq = self.holdings.position(store)
            try:
                reply = await client.tier_events(seq, epoch, EVENTS_TIMEOUT_SECONDS)
            except WorkerError as error:
                problems.append(f"{worker_id}: {error}")
                continue
            self.holdings.apply(store, reply)
            if self.errors.pop(store, None) is not None:
                logger.info("node store %s on %s followed again (%d blocks)", store[1], store[0],
                            self.holdings.num_blocks(store))
            return True
        error = "; ".join(problems) or "no worker uses it"
        if store not in self.errors:
            logger.warning("node store %s on %s cannot be followed (%s); its blocks are not counted on",
                           store[1], store[0], error)
        self.errors[store] = error
        self.holdings.forget(store)
        return False

    async def _follow(self, store: StoreKey) -> None:
        while True:
            await self.poll(store)
            await asyncio.sleep(self.poll_seconds)
