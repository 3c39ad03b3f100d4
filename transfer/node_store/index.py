"""The node store's index: which blocks it holds, in which tier and slot, and what goes
when room is needed. Deterministic and free of I/O: the store process
(``transfer.node_store.server``) performs the moves it returns, in order, before it
writes the block that caused them. Time is passed in.

::

    admit(key) ──▶ a free host slot, or the least recently used unpinned host block's:
                     that block is demoted to disk (Demote: copy its slot to a disk slot,
                     the least recently used disk block dropped if none is free), or
                     dropped when there is no disk tier
    promote(key) ─▶ a disk block comes back into a host slot the same way (its disk slot
                     is freed once the store has read it: the next call)
    leading(keys) ─▶ how many of ``keys`` are held, from the first, in any tier

Blocks are keyed by kvroute's namespaced chain hash (``foundation.identity``), which
covers the cache salt and every earlier token of the prompt, so two tenants never share a
key. A block being read by a consumer is pinned until a deadline and is not evicted
before it. Every block stored or removed is recorded in ``events``
(``transfer.node_store.events``), which the orchestrators' indexes read.

Single writer: the store's one thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum

from transfer.node_store.events import EventLog, StoreEvent

BlockKey = bytes  # a namespaced chain hash, 16 bytes (foundation.identity)


class Tier(str, Enum):
    HOST = "host"
    DISK = "disk"


@dataclass
class Entry:
    tier: Tier
    slot: int
    checksum: int = 0  # xxh3-64 of the block's bytes, set once they are written
    pinned_until: float = 0.0


@dataclass(frozen=True)
class Demote:
    """Copy host slot ``host_slot`` to disk slot ``disk_slot``; the host slot is then reused."""

    key: BlockKey
    host_slot: int
    disk_slot: int


@dataclass(frozen=True)
class Drop:
    """The block is no longer held; its slot in ``tier`` is free."""

    key: BlockKey
    tier: Tier
    slot: int


Move = Demote | Drop


@dataclass(frozen=True)
class Admission:
    slot: int  # the host slot to write the new block into
    moves: tuple[Move, ...]  # to perform first, in order


@dataclass(frozen=True)
class Promotion:
    host_slot: int  # where to read the block back into
    disk_slot: int  # where it lies on disk
    moves: tuple[Move, ...]  # to perform first, in order


class SlotPool:
    """Free slot numbers, lowest first."""

    def __init__(self, count: int):
        self.count = count
        self._free = list(range(count - 1, -1, -1))

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)


class TierIndex:
    def __init__(self, host_slots: int, disk_slots: int = 0):
        if host_slots < 1:
            raise ValueError("the host tier needs room for at least one block")
        if disk_slots < 0:
            raise ValueError("disk_slots must not be negative")
        self._entries: dict[BlockKey, Entry] = {}
        self._recency = {Tier.HOST: OrderedDict(), Tier.DISK: OrderedDict()}  # least recently used first
        self._slots = {Tier.HOST: SlotPool(host_slots), Tier.DISK: SlotPool(disk_slots)}
        self.events = EventLog()

    # ---------------------------------------------------------------- questions

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, key: BlockKey) -> Entry | None:
        return self._entries.get(key)

    def num_blocks(self, tier: Tier) -> int:
        return len(self._recency[tier])

    def capacity(self, tier: Tier) -> int:
        return self._slots[tier].count

    def leading(self, keys: list[BlockKey]) -> int:
        """How many of ``keys``, from the first, are held (in any tier); those become the
        most recently used, as a consumer is about to ask for them."""
        count = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                break
            self._recency[entry.tier].move_to_end(key)
            count += 1
        return count

    def lacking(self, keys: list[BlockKey]) -> list[BlockKey]:
        return [key for key in keys if key not in self._entries]

    # ---------------------------------------------------------------- changes

    def admit(self, key: BlockKey, now: float) -> Admission | None:
        """A host slot for a new block (held from now on; its checksum comes with
        ``set_checksum``), or None when every host block is pinned."""
        if key in self._entries:
            raise KeyError("block already held")
        found = self._host_slot(now)
        if found is None:
            return None
        slot, moves = found
        self._entries[key] = Entry(Tier.HOST, slot)
        self._recency[Tier.HOST][key] = None
        self.events.append(StoreEvent("stored", key, Tier.HOST))
        return Admission(slot, moves)

    def set_checksum(self, key: BlockKey, checksum: int) -> None:
        self._entries[key].checksum = checksum

    def pin(self, keys: list[BlockKey], until: float) -> None:
        """Keep these host blocks from eviction until ``until`` (a consumer reads them)."""
        for key in keys:
            entry = self._entries[key]
            entry.pinned_until = max(entry.pinned_until, until)

    def promote(self, key: BlockKey, now: float) -> Promotion | None:
        """Bring a disk block back into a host slot; None when every host block is pinned."""
        entry = self._entries[key]
        if entry.tier is not Tier.DISK:
            raise ValueError("only a disk block is promoted")
        del self._recency[Tier.DISK][key]  # so that making room cannot evict it
        found = self._host_slot(now)
        if found is None:
            self._recency[Tier.DISK][key] = None
            return None
        host_slot, moves = found
        disk_slot = entry.slot
        self._slots[Tier.DISK].give(disk_slot)  # reused no earlier than the next call, after the read
        entry.tier, entry.slot = Tier.HOST, host_slot
        self._recency[Tier.HOST][key] = None
        self.events.append(StoreEvent("removed", key, Tier.DISK), StoreEvent("stored", key, Tier.HOST))
        return Promotion(host_slot, disk_slot, moves)

    def remove(self, key: BlockKey) -> Drop | None:
        """Forget a block (e.g. its bytes failed their checksum); None if not held."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        del self._recency[entry.tier][key]
        self._slots[entry.tier].give(entry.slot)
        self.events.append(StoreEvent("removed", key, entry.tier))
        return Drop(key, entry.tier, entry.slot)

    def clear(self) -> list[Drop]:
        return [drop for key in list(self._entries) if (drop := self.remove(key)) is not None]

    def holdings(self) -> list[StoreEvent]:
        """Every block held, as a "stored" event in its tier: a reader's snapshot."""
        return [StoreEvent("stored", key, entry.tier.value) for key, entry in self._entries.items()]

    # ---------------------------------------------------------------- making room

    def _host_slot(self, now: float) -> tuple[int, tuple[Move, ...]] | None:
        slot = self._slots[Tier.HOST].take()
        if slot is not None:
            return slot, ()
        victim = self._oldest_unpinned(now)
        if victim is None:
            return None
        moves = self._evict_from_host(victim)
        return self._slots[Tier.HOST].take(), moves

    def _oldest_unpinned(self, now: float) -> BlockKey | None:
        for key in self._recency[Tier.HOST]:
            if self._entries[key].pinned_until <= now:
                return key
        return None

    def _evict_from_host(self, key: BlockKey) -> tuple[Move, ...]:
        """Demote ``key`` to disk when there is a disk tier, else drop it."""
        entry = self._entries[key]
        if self._slots[Tier.DISK].count == 0:
            return (self.remove(key),)
        moves: list[Move] = []
        disk_slot = self._slots[Tier.DISK].take()
        if disk_slot is None:
            oldest = next(iter(self._recency[Tier.DISK]), None)
            if oldest is None:  # the one disk block is being promoted
                return (self.remove(key),)
            moves.append(self.remove(oldest))
            disk_slot = self._slots[Tier.DISK].take()
        host_slot = entry.slot
        del self._recency[Tier.HOST][key]
        self._slots[Tier.HOST].give(host_slot)
        entry.tier, entry.slot, entry.pinned_until = Tier.DISK, disk_slot, 0.0
        self._recency[Tier.DISK][key] = None
        self.events.append(StoreEvent("removed", key, Tier.HOST), StoreEvent("stored", key, Tier.DISK))
        moves.append(Demote(key, host_slot, disk_slot))
        return tuple(moves)
