"""A producer's staged leases, offered for consumers to READ with NIXL straight into their
caches (``transfer.direct_reads``): the arena's registration, pins, and confirmations.
Arena leases offered as shared copies (``transfer.shared_copies``) are pinned and confirmed
the same way (``pin``, ``confirm``): a consumer's ``preadv`` cannot be refused either.

::

    PullBlocks(direct) ──▶ offer: pin the lease's region of the staging arena
                           ──▶ PullHeader(direct=DirectRef(agent, metadata, arena, offsets, pin))
    consumer READs ...     (the region is not reused while pinned)
    ConfirmRead(pin)   ──▶ valid iff the pin is still held and the lease still live; unpin

Leases offered this way lie in the process's staging arena (``transfer.staging_arena``),
which is registered with the agent once, on the first offer, and never deregistered: no
registration on a pull's path, and metadata that never changes, so a consumer loads it once
(it cannot forget a registration, so a per-lease one reused an old one's addresses).

A one-sided READ cannot be refused by its target, so the producer never vouches for a READ
it cannot see: it vouches, in ``ConfirmRead``'s answer, for the time between its offer and
the confirmation, and the consumer sends that only once its READ completed. A lease that
ended before the confirmation (released, expired) answers no, and the consumer recomputes:
a lease's descriptors are invalid once it ends. A pin holds the lease's region (the arena
reuses it only when the lease ended and its pins are done), so a late READ reads the same
bytes or fails, never another lease's; a pin lapses after PIN_SECONDS (longer than any
pull's deadline), and a confirmation after that is refused as well.

Used only on the block server's thread.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

from foundation.wire import DirectRef
from transfer.direct_descriptors import layer_segments, segments_digest
from transfer.kv_layout import PagedKVCache
from transfer.leases import Lease
from transfer.staging_arena import StagingArena
from transfer.transports.nixl_agent import Agent

PIN_SECONDS = 15.0  # longer than any pull's deadline (pull_timeout_seconds: 10 by default)


@dataclass
class _Pin:
    """A hold on a lease's region (``staging_arena.Hold``) for one offered pull."""

    handle: str
    lapses_at: float
    done: bool = False


class DirectExports:
    def __init__(self, cache: PagedKVCache, agent: Callable[[], Agent]):
        """``agent``: the producer's NIXL agent, made on the first offer."""
        self._cache = cache
        self._make_agent = agent
        self._agent: Agent | None = None
        self._pins: dict[int, _Pin] = {}
        self._pin_numbers = itertools.count(1)

    @property
    def pinned(self) -> bool:
        """Some consumer may be reading: pins lapse, and a READ needs the agent's progress (``tend``)."""
        return bool(self._pins)

    def offer(self, lease: Lease, positions: list[int], checksum: bool, now: float) -> DirectRef | None:
        """A pinned DirectRef to the lease's blocks at ``positions``; None when the lease does
        not lie in the staging arena (in place, or staged elsewhere: it is sent as frames)."""
        region = lease.region
        if region is None:
            return None
        if self._agent is None:
            self._agent = self._make_agent()
        metadata = exported_metadata(region.arena, self._agent)
        number = self.pin(lease, now)
        return DirectRef(agent=self._agent.name, metadata=metadata, arena_address=region.arena.address,
                         arena_bytes=region.arena.nbytes, num_blocks=len(lease.block_ids), pin=number,
                         layer_offsets=[layer.data_ptr() - region.arena.address for layer in lease.staged],
                         digests=self._digests(lease, positions) if checksum else None)

    def pin(self, lease: Lease, now: float) -> int:
        """Hold the region of ``lease`` (in the staging arena) for one read; the pin's number,
        which the consumer's ``ConfirmRead`` names."""
        number, pin = next(self._pin_numbers), _Pin(lease.handle, now + PIN_SECONDS)
        lease.region.hold(pin)
        self._pins[number] = pin
        return number

    def _digests(self, lease: Lease, positions: list[int]) -> bytes:
        """Per layer, the digest of the frame of these positions, hashed where it lies."""
        leads, row_bytes = self._cache.row_geometry()
        count = len(lease.block_ids)
        segments = layer_segments(positions, range(len(positions)), count, max(len(positions), 1), leads, row_bytes)
        return b"".join(segments_digest(layer, segments[:, 0], segments[:, 2]) for layer in lease.staged)

    def confirm(self, handle: str, number: int, live: bool, now: float) -> tuple[bool, str]:
        """(valid, why not): the pin's READ may be trusted; the pin ends either way."""
        pin = self._pins.pop(number, None)
        if pin is not None:
            pin.done = True
        if pin is None or pin.handle != handle or pin.lapses_at <= now:
            return False, "the pull's pin lapsed or was never given; its READ may have missed the lease"
        if not live:
            return False, "the lease ended during the READ; its descriptors are no longer valid"
        return True, ""

    def tend(self, now: float) -> None:
        """Progress the agent while a READ may run; let lapsed pins go."""
        if not self._pins:
            return
        if self._agent is not None:  # pins of shared-copy reads alone need no agent
            self._agent.progress()
        for number, pin in list(self._pins.items()):
            if pin.lapses_at <= now:
                pin.done = True
                del self._pins[number]

    def close(self) -> None:
        """Let every pin go: the regions they held may be reused (the arena stays registered)."""
        for pin in self._pins.values():
            pin.done = True
        self._pins.clear()


# (id of an arena, agent name) -> the registration and the metadata a peer loads to READ that
# arena: registered once per process, as arenas and agents live as long as it does.
_exported: dict[tuple[int, str], tuple[object, bytes]] = {}
_exported_lock = threading.Lock()


def exported_metadata(arena: StagingArena, agent: Agent) -> bytes:
    """The agent's connection and its registration of ``arena``, registering it on first use."""
    key = (id(arena), agent.name)
    with _exported_lock:
        if key not in _exported:
            _exported[key] = agent.register_for_peers([arena.tensor])
        return _exported[key][1]
