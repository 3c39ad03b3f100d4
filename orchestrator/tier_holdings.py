"""Which blocks each node KV store holds, and in which tier: the orchestrator's view of the
node tier (``transfer.node_store``), as ``orchestrator.tier_sync`` reads it from the stores'
events. Mechanism only: the planner prices what it finds here.

A store is keyed by (host, address) (``registry.WorkerView.node_store``): every worker on
that host naming that address shares it. Blocks are kvroute's namespaced chain hashes, the
same the prefix index and the store use, so a prompt's hashes look up both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from foundation import identity, wire

StoreKey = tuple[str, str]  # (host, the store's address there)
HOST, DISK = "host", "disk"


@dataclass(frozen=True)
class TierRun:
    """Consecutive prompt blocks a store holds from some block on, by tier."""

    host_blocks: int = 0
    disk_blocks: int = 0

    @property
    def blocks(self) -> int:
        return self.host_blocks + self.disk_blocks


NO_RUN = TierRun()


@dataclass
class _Store:
    epoch: str = ""
    seq: int = 0
    tiers: dict[identity.BlockHash, str] = field(default_factory=dict)


class TierHoldings:
    """Single writer: the tier sync's tasks; readers: the completion service's placements."""

    def __init__(self):
        self._stores: dict[StoreKey, _Store] = {}

    def position(self, store: StoreKey) -> tuple[str, int]:
        """(epoch, seq) of the last event applied: where the next request for events starts."""
        entries = self._stores.get(store)
        return (entries.epoch, entries.seq) if entries else ("", 0)

    def apply(self, store: StoreKey, reply: wire.TierEventsReply) -> None:
        """A store's events (or its snapshot, which replaces what was known of it)."""
        entries = self._stores.get(store)
        if reply.snapshot or entries is None or entries.epoch != reply.epoch:
            entries = self._stores[store] = _Store()
        tiers = entries.tiers
        for event in reply.events:
            block = int.from_bytes(event.key, "little")
            if event.stored:
                tiers[block] = event.tier
            elif tiers.get(block) == event.tier:  # a "removed" from a tier it has left already is old news
                del tiers[block]
        entries.epoch, entries.seq = reply.epoch, reply.seq

    def forget(self, store: StoreKey) -> None:
        """The store is gone or out of reach: nothing is priced as held there."""
        self._stores.pop(store, None)

    def stores(self) -> list[StoreKey]:
        return list(self._stores)

    @property
    def num_stores(self) -> int:
        return len(self._stores)

    def num_blocks(self, store: StoreKey, tier: str | None = None) -> int:
        entries = self._stores.get(store)
        if entries is None:
            return 0
        if tier is None:
            return len(entries.tiers)
        return sum(1 for held in entries.tiers.values() if held == tier)

    def reach(self, block_hashes: list[identity.BlockHash]) -> Callable[[StoreKey | None, int], int]:
        """``reach(store, start)``: ``start`` plus the run ``store`` holds from there, for many
        workers of one prompt. Most workers hold nothing of it (start 0) and share a store
        with others, so the run from block 0 is worked out once per store."""
        from_zero: dict[StoreKey, int] = {}

        def reach(store: StoreKey | None, start: int) -> int:
            if store is None or store not in self._stores:
                return start
            if start:
                return start + self.run(store, block_hashes, start).blocks
            if store not in from_zero:
                from_zero[store] = self.run(store, block_hashes, 0).blocks
            return from_zero[store]

        return reach

    def run(self, store: StoreKey | None, block_hashes: list[identity.BlockHash], start: int) -> TierRun:
        """The blocks of ``block_hashes`` from ``start`` on that ``store`` holds without a gap:
        what a worker whose engine holds the first ``start`` blocks would load from it."""
        entries = self._stores.get(store) if store is not None else None
        if entries is None or not entries.tiers:
            return NO_RUN
        host = disk = 0
        for block in block_hashes[start:]:
            tier = entries.tiers.get(block)
            if tier is None:
                break
            if tier == DISK:
                disk += 1
            else:
                host += 1
        return TierRun(host, disk) if host or disk else NO_RUN
