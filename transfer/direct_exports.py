"""A producer's staged leases, registered with NIXL for consumers to READ straight into their
caches (``transfer.direct_reads``): registrations, pins, and when memory may go.

::

    PullBlocks(direct) ──▶ offer: register the lease's copy (first pull only), pin it
                           ──▶ PullHeader(direct=DirectRef(agent, metadata, addresses, pin))
    consumer READs ...     (the copy stays mapped and registered while pinned)
    ConfirmRead(pin)   ──▶ valid iff the pin is still held and the lease still live; unpin
    lease ended, no pins ──▶ deregister; the copy's memory goes with its last reference

A one-sided READ cannot be refused by its target, so the producer never vouches for a READ
it cannot see: it vouches, in ``ConfirmRead``'s answer, for the time between its offer and
the confirmation, and the consumer sends that only once its READ completed. A lease that
ended before the confirmation (released, expired) answers no, and the consumer recomputes:
a lease's descriptors are invalid once it ends. Pins only keep the memory from being
unmapped or reused while a READ might still run, so a late READ reads the same bytes or
fails, never another lease's; a pin lapses after PIN_SECONDS (longer than any pull's
deadline), and a confirmation after that is refused as well.

A lease's copy is registered once, on its first direct pull, and kept until the lease ends:
every later pull of it (a delta pull by another consumer) reuses it. Staged copies are one
memfd per lease, not a pool, so each staged lease that is pulled directly costs one
registration (about 1 ms for 8 MiB here).

Used only on the block server's thread.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from foundation.wire import DirectRef
from transfer.direct_descriptors import layer_segments, segments_digest
from transfer.kv_layout import PagedKVCache
from transfer.leases import Lease
from transfer.transports.nixl_agent import Agent

logger = logging.getLogger("kvroute.transfer.direct")

PIN_SECONDS = 15.0  # longer than any pull's deadline (pull_timeout_seconds: 10 by default)


@dataclass
class _Export:
    """One lease's copy as registered: the tensors hold its memory mapped while we do."""

    registration: object
    metadata: bytes
    memory: tuple[torch.Tensor, ...]
    layer_addresses: list[int]
    pins: dict[int, float] = field(default_factory=dict)  # pin -> when it lapses


class DirectExports:
    def __init__(self, cache: PagedKVCache, agent: Callable[[], Agent]):
        """``agent``: the producer's NIXL agent, made on the first offer."""
        self._cache = cache
        self._make_agent = agent
        self._agent: Agent | None = None
        self._exports: dict[str, _Export] = {}  # by lease handle
        self._pins = itertools.count(1)
        self.num_registrations = 0  # one per lease pulled directly, however many pulls it serves

    @property
    def pinned(self) -> bool:
        """Some consumer may be READing: the agent needs progress (``tend``)."""
        return any(export.pins for export in self._exports.values())


    def offer(self, lease: Lease, positions: list[int], checksum: bool, now: float) -> DirectRef | None:
        """A pinned DirectRef to the lease's blocks at ``positions``; None when the lease is not
        staged (its blocks are still the engine's, which may reuse them after it ends)."""
        if lease.staged is None:
            return None
        export = self._exports.get(lease.handle) or self._register(lease)
        pin = next(self._pins)
        export.pins[pin] = now + PIN_SECONDS
        return DirectRef(agent=self._agent.name, metadata=export.metadata, layer_addresses=export.layer_addresses,
                         num_blocks=len(lease.block_ids), pin=pin,
                         digests=self._digests(lease, positions) if checksum else None)

    def _register(self, lease: Lease) -> _Export:
        if self._agent is None:
            self._agent = self._make_agent()
        # A shared copy is one memfd holding every layer: one region. A private copy is a tensor per layer.
        memory = (lease.shared.tensor(),) if lease.shared is not None else tuple(lease.staged)
        registration, metadata = self._agent.register_for_peers(list(memory))
        self.num_registrations += 1
        export = _Export(registration, metadata, memory, [layer.data_ptr() for layer in lease.staged])
        self._exports[lease.handle] = export
        return export

    def _digests(self, lease: Lease, positions: list[int]) -> bytes:
        """Per layer, the digest of the frame of these positions, hashed where it lies."""
        leads, row_bytes = self._cache.row_geometry()
        count = len(lease.block_ids)
        segments = layer_segments(positions, range(len(positions)), count, max(len(positions), 1), leads, row_bytes)
        return b"".join(segments_digest(layer, segments[:, 0], segments[:, 2]) for layer in lease.staged)

    def confirm(self, handle: str, pin: int, live: bool, now: float) -> tuple[bool, str]:
        """(valid, why not): the pin's READ may be trusted; the pin ends either way."""
        export = self._exports.get(handle)
        lapses_at = export.pins.pop(pin, None) if export is not None else None
        if lapses_at is None or lapses_at <= now:
            return False, "the pull's pin lapsed or was never given; its READ may have missed the lease"
        if not live:
            return False, "the lease ended during the READ; its descriptors are no longer valid"
        return True, ""

    def tend(self, now: float, is_live: Callable[[str], bool]) -> None:
        """Progress the agent while a READ may run; drop lapsed pins, and the registrations of
        leases that ended with no pin left."""
        if self.pinned:
            self._agent.progress()
        for handle, export in list(self._exports.items()):
            export.pins = {pin: until for pin, until in export.pins.items() if until > now}
            if not export.pins and not is_live(handle):
                self._forget(handle)

    def _forget(self, handle: str) -> None:
        export = self._exports.pop(handle)
        try:
            self._agent.deregister(export.registration)
        except Exception:  # noqa: BLE001 - the memory goes with the export all the same
            logger.exception("deregistering a lease's copy from NIXL failed")

    def close(self) -> None:
        for handle in list(self._exports):
            self._forget(handle)
