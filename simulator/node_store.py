"""The node KV tier in the simulator: a store per node behind every engine cache there.

Each store moves blocks as kvroute's own (``transfer.node_store.index.TierIndex``) does: a
host-memory tier in LRU order whose least recently used block is demoted to the disk tier
when room is needed (dropped without one; a full disk tier drops its own least recently
used), a lookup marking the blocks it finds most recently used, and a read of a disk block
bringing it back into host memory; every block stored or removed is an event, as the
store's log records them. It keeps no slots (a list of every free slot, per node, was a
gigabyte at 1,000 workers). Around it:

* **which workers share a store**: the cluster's workers in order, the prefill pool first,
  ``workers_per_node`` to a node (``node_names``);
* **a load**: the run of prompt blocks the store holds past an engine's own hit, short of
  the last prompt token (``held_run``), taken at once when the engine starts it (``load``);
  it takes ``SimCalibration.tier_load_seconds`` (per tier: latency + bytes / bandwidth);
* **a write-through**: when a request ends, the full prompt blocks it computed itself
  (``Engine.take_saves``) are stored, those already held skipped (``write``), at once.

Not modelled: loads on one node slowing each other, the write-through's copy time, and
blocks pinned after a load (it reads them at once, when it starts: they are pinned only
while it brings its disk blocks back).

Single writer: the simulation loop. Engines only read a store (``held_run``); the fleet
hands each store's events to the orchestrator's ``TierHoldings`` after every change
(``take_events``), as the tier sync does in service.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from foundation import wire
from foundation.identity import BlockHash
from orchestrator.tier_holdings import DISK, HOST, NO_RUN, TierRun


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


@dataclass(frozen=True)
class StoreStats:
    node: str
    host_blocks: int  # held at the end
    disk_blocks: int
    written_blocks: int  # by write-throughs, in all
    loaded_blocks: int  # into engines, in all


class NodeStore:
    def __init__(self, name: str, settings: TierSettings):
        if not settings.enabled:
            raise ValueError("a node store needs room for at least one block in host memory")
        self.name = name
        self.capacity = {HOST: settings.host_blocks, DISK: settings.disk_blocks}
        self._tiers: dict[str, OrderedDict[BlockHash, None]] = {HOST: OrderedDict(), DISK: OrderedDict()}  # LRU first
        self._events: list[wire.TierEvent] = []  # since the last ``take_events``
        self._seq = 0  # events in all
        self.num_loaded = self.num_written = 0  # blocks

    def tier_of(self, block: BlockHash) -> str | None:
        for tier, held in self._tiers.items():
            if block in held:
                return tier
        return None

    def held_run(self, blocks: list[BlockHash], start: int, stop: int) -> TierRun:
        """The blocks ``start`` to ``stop`` of ``blocks`` held without a gap from ``start``, by tier."""
        host, disk = self._tiers[HOST], self._tiers[DISK]
        in_host = in_disk = 0
        for block in blocks[start:stop]:
            if block in host:
                in_host += 1
            elif block in disk:
                in_disk += 1
            else:
                break
        return TierRun(in_host, in_disk) if in_host or in_disk else NO_RUN

    def load(self, blocks: list[BlockHash], start: int, count: int) -> None:
        """An engine reads ``count`` blocks from ``start`` (held when it asked, ``held_run``):
        a lookup makes them the most recently used, and each disk block comes back to host
        memory. (Loads an engine starts in one step are read in turn; one may push a block of
        the next off a small disk tier: that block is read all the same, as it was asked for.)"""
        wanted = [block for block in blocks[start:start + count] if self.tier_of(block) is not None]
        tiers = [self.tier_of(block) for block in wanted]
        for block, tier in zip(wanted, tiers):
            self._tiers[tier].move_to_end(block)
        # As the store serves a read: its host blocks pinned, then each disk block brought back
        # and pinned in turn, so that making room for one never evicts another of the same read.
        pinned = {block for block, tier in zip(wanted, tiers) if tier == HOST}
        for block in wanted:
            if block in self._tiers[DISK] and self._promote(block, pinned):
                pinned.add(block)
        self.num_loaded += count

    def write(self, blocks: list[BlockHash]) -> int:
        """Store the blocks not held when the write begins (a put skips the others, even one
        that making room for an earlier block drops); how many were stored."""
        lacking = [block for block in blocks if self.tier_of(block) is None]
        for block in lacking:
            self._make_host_room()
            self._add(block, HOST)
        self.num_written += len(lacking)
        return len(lacking)

    def stats(self) -> StoreStats:
        return StoreStats(self.name, len(self._tiers[HOST]), len(self._tiers[DISK]), self.num_written,
                          self.num_loaded)

    def take_events(self) -> wire.TierEventsReply:
        """What the store stored and removed since the last call, as its server answers a tier sync."""
        events, self._events = self._events, []
        return wire.TierEventsReply(epoch=self.name, seq=self._seq, events=events)

    # ------------------------------------------------------------ moving blocks

    def _promote(self, block: BlockHash, pinned: set[BlockHash]) -> bool:
        """A disk block back into host memory; False (it stays on disk) when every host block
        is pinned. Its disk slot is freed only after the room is made (``TierIndex.promote``):
        a demotion meanwhile may drop another disk block, never this one."""
        del self._tiers[DISK][block]
        if not self._make_host_room(disk_reserved=1, pinned=pinned):
            self._tiers[DISK][block] = None
            return False
        self._record(False, DISK, block)
        self._add(block, HOST)
        return True

    def _make_host_room(self, disk_reserved: int = 0, pinned: set[BlockHash] | frozenset = frozenset()) -> bool:
        """If host memory is full, demote its least recently used unpinned block to disk
        (dropping the oldest disk block when the disk tier is full), or drop it without a disk
        tier. False when every host block is pinned."""
        host, disk = self._tiers[HOST], self._tiers[DISK]
        if len(host) < self.capacity[HOST]:
            return True
        victim = next((block for block in host if block not in pinned), None)
        if victim is None:
            return False
        if not self.capacity[DISK] or (not disk and disk_reserved >= self.capacity[DISK]):
            self._remove(victim, HOST)
            return True
        if len(disk) + disk_reserved >= self.capacity[DISK]:
            self._remove(next(iter(disk)), DISK)
        self._remove(victim, HOST)
        self._add(victim, DISK)
        return True

    def _add(self, block: BlockHash, tier: str) -> None:
        self._tiers[tier][block] = None
        self._record(True, tier, block)

    def _remove(self, block: BlockHash, tier: str) -> None:
        del self._tiers[tier][block]
        self._record(False, tier, block)

    def _record(self, stored: bool, tier: str, block: BlockHash) -> None:
        self._events.append(wire.TierEvent(stored, tier, block.to_bytes(16, "little")))
        self._seq += 1
