"""The node KV tier in the simulator: a store per node behind every engine cache there.

Each store is kvroute's own bookkeeping (``transfer.node_store.index.TierIndex``): a host-
memory tier in LRU order whose least recently used block is demoted to the disk tier when
room is needed (dropped without one; the disk tier drops its own least recently used), a
lookup marking the blocks it finds most recently used, and a read of a disk block bringing
it back into host memory. What is simulated here is around it:

* **which workers share a store**: the cluster's workers in order, the prefill pool first,
  ``workers_per_node`` to a node (``node_names``);
* **a load**: the run of prompt blocks the store holds past an engine's own hit, short of
  the last prompt token (``held_run``), taken at once when the engine starts it (``load``);
  it takes ``SimCalibration.tier_load_seconds`` (per tier: latency + bytes / bandwidth);
* **a write-through**: when a request ends, the full prompt blocks it computed itself
  (``Engine.take_saves``) are stored, those already held skipped (``write``), at once.

Not modelled: loads on one node slowing each other, the write-through's copy time, and
blocks pinned while a load reads them (a load takes its blocks when it starts).

Single writer: the simulation loop. Engines only read a store (``held_run``); the fleet
hands each store's events to the orchestrator's ``TierHoldings`` after every change
(``take_events``), as the tier sync does in service.
"""

from __future__ import annotations

from dataclasses import dataclass

from foundation import wire
from foundation.identity import BlockHash
from orchestrator.tier_holdings import NO_RUN, TierRun
from transfer.node_store.events import EventLog
from transfer.node_store.index import Tier, TierIndex

EVENTS_KEPT = 4096


@dataclass(frozen=True)
class TierSettings:
    """Per node: blocks of the engines' block size in host memory and on disk. No host
    blocks (the default): no node stores, the cluster as it runs without them.
    ``workers_per_node``: 8, an eight-accelerator host; 0: every worker on one node."""

    host_blocks: int = 0
    disk_blocks: int = 0
    workers_per_node: int = 8

    def __post_init__(self):
        for name in ("host_blocks", "disk_blocks", "workers_per_node"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.disk_blocks and not self.host_blocks:
            raise ValueError("a disk tier needs a host tier in front of it")

    @property
    def enabled(self) -> bool:
        return self.host_blocks > 0


def node_names(worker_ids: list[str], workers_per_node: int) -> dict[str, str]:
    """Worker id → its node: ``worker_ids`` in order, ``workers_per_node`` to a node (0: one)."""
    per_node = workers_per_node or max(1, len(worker_ids))
    width = len(str(max(0, len(worker_ids) - 1) // per_node))
    return {worker_id: f"node-{position // per_node:0{width}d}" for position, worker_id in enumerate(worker_ids)}


def store_key(block: BlockHash) -> bytes:
    """The store's name of a block: its chain hash, 16 bytes little-endian (``transfer.tier_scheduler``)."""
    return block.to_bytes(16, "little")


@dataclass(frozen=True)
class StoreStats:
    node: str
    host_blocks: int  # held at the end
    disk_blocks: int
    written_blocks: int  # by write-throughs, in all
    loaded_blocks: int  # into engines, in all


class NodeStore:
    def __init__(self, name: str, settings: TierSettings):
        self.name = name
        self.index = TierIndex(settings.host_blocks, settings.disk_blocks)
        # Events are taken after every change, a write-through's few thousand at most: a short
        # log keeps taking them cheap (reading the log skips what it keeps before them), and
        # a longer gap still reaches the holdings, as a snapshot.
        self.index.events = EventLog(max_events=EVENTS_KEPT)
        self._published = 0  # the last event handed to the holdings
        self.num_loaded = self.num_written = 0  # blocks

    def held_run(self, blocks: list[BlockHash], start: int, stop: int) -> TierRun:
        """The blocks ``start`` to ``stop`` of ``blocks`` held without a gap from ``start``, by tier."""
        host = disk = 0
        for block in blocks[start:stop]:
            entry = self.index.entry(store_key(block))
            if entry is None:
                break
            if entry.tier is Tier.DISK:
                disk += 1
            else:
                host += 1
        return TierRun(host, disk) if host or disk else NO_RUN

    def load(self, blocks: list[BlockHash], start: int, count: int) -> None:
        """An engine reads ``count`` blocks from ``start`` (held, ``held_run``): a lookup
        makes them the most recently used, and each disk block comes back to host memory."""
        keys = [store_key(block) for block in blocks[start:start + count]]
        if self.index.leading(keys) != len(keys):
            raise AssertionError(f"{self.name} was asked to load blocks it does not hold")
        for key in keys:
            if self.index.entry(key).tier is Tier.DISK and self.index.promote(key, 0.0) is None:
                raise AssertionError("no host slot for a disk block: the simulator pins none")
        self.num_loaded += count

    def write(self, blocks: list[BlockHash]) -> int:
        """Store the blocks not held yet (a put skips the others); how many were stored."""
        stored = 0
        for block in blocks:
            key = store_key(block)
            if key not in self.index and self.index.admit(key, 0.0) is not None:
                stored += 1
        self.num_written += stored
        return stored

    def stats(self) -> StoreStats:
        return StoreStats(self.name, self.index.num_blocks(Tier.HOST), self.index.num_blocks(Tier.DISK),
                          self.num_written, self.num_loaded)

    def take_events(self) -> wire.TierEventsReply:
        """What the store stored and removed since the last call, as its server answers a
        tier sync (a snapshot if the log no longer keeps them all)."""
        log = self.index.events
        events = log.since(log.epoch, self._published)
        snapshot = events is None
        if snapshot:
            events = self.index.holdings()
        self._published = log.seq
        return wire.TierEventsReply(epoch=log.epoch, seq=log.seq, snapshot=snapshot,
                                    events=[wire.TierEvent(e.kind == "stored", Tier(e.tier).value, e.key)
                                            for e in events])
