"""Leases on a producer's finished prompt blocks.

::

    request_finished ──grant──▶ STAGING ──staged──▶ STAGED (host copy; engine blocks freed)
                       │            │                  │
                       │            └──release──▶ ENDING ──staged──▶ gone
                       └─(no room to stage)──▶ IN PLACE (engine keeps the blocks)
    any live lease ──release (ack, local hit, abort, rejection) or expire──▶ gone

vLLM keeps a leased request's blocks allocated (the connector returned
``delay_free=True``) until the table reports its request id. While a request holds
blocks that way, vLLM's engine loop keeps stepping — on CPU that spins a core and
starves the block server in the same process. So a lease is normally *staged*: its
blocks are copied to host buffers the lease owns (in the process's staging arena:
``transfer.staging_arena``; when it is full, in shared memory of its own where that can be
had, for consumers on this host: ``transfer.shared_copies``; the lease closes either when it
ends), the request id is reported at once, and the engine goes idle. A lease that does
not fit the staging budget stays in place.

Every request id is reported exactly once, and never while a staging copy still reads
its blocks: a lease released mid-copy is reported when the copy finishes.

A lease is servable only IN PLACE or STAGED; a pull for a lease still STAGING waits
(the block server parks it). The handles of the most recent expired leases are
remembered, so a pull that comes too late is refused at once instead of waiting for a
grant that will never come. Time is passed in; the table holds no clock.
Thread-safe: the block server thread, the pull threads and the engine's step thread
all use it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transfer.shared_copies import SharedCopy
    from transfer.staging_arena import Region

REMEMBERED_EXPIRED_HANDLES = 4096  # ~150 KB; a late pull comes seconds after expiry, not 4096 leases later


@dataclass(frozen=True)
class Lease:
    handle: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    expires_at: float
    # One contiguous tensor per layer, blocks in lease order; None while in place or staging.
    staged: tuple[torch.Tensor, ...] | None = None
    staged_bytes: int = 0  # charged to the staging budget (also while the copy runs)
    pulled: bool = False  # served at least once (an expiry then means a lost acknowledgement)
    # The shared-memory file ``staged`` lies in, for consumers on this host; closed when the
    # lease ends (transfer.shared_copies).
    shared: SharedCopy | None = None
    # The region of this process's staging arena ``staged`` lies in, for NIXL READs
    # (transfer.staging_arena); closed when the lease ends, freed once nothing reads it.
    region: Region | None = None


class LeaseTable:
    """One writer per lease: granted and staged by the engine thread, ended by whoever
    comes first."""

    def __init__(self):
        self._leases: dict[str, Lease] = {}
        self._staging: set[str] = set()  # handles whose copy is running
        self._ending: dict[str, tuple[str, int]] = {}  # ended while staging: (request id, bytes)
        self._ended_request_ids: set[str] = set()
        self._expired_handles: OrderedDict[str, None] = OrderedDict()  # most recent last
        self._lock = threading.Lock()
        self.num_granted = 0
        self.num_released = 0
        self.num_expired = 0
        self.num_staged = 0
        self.staged_bytes = 0  # staged and being staged: what the staging budget is charged

    def grant(self, lease: Lease, staging_bytes: int = 0) -> None:
        """``staging_bytes`` > 0: a copy of that size will follow (``finish_staging``) and
        counts against the budget from now on; nothing is served before it."""
        with self._lock:
            if staging_bytes > 0:
                lease = replace(lease, staged_bytes=staging_bytes)
                self._staging.add(lease.handle)
                self.staged_bytes += staging_bytes
            self._leases[lease.handle] = lease
            self.num_granted += 1

    def finish_staging(self, handle: str, layers: tuple[torch.Tensor, ...] | None,
                       shared: SharedCopy | None = None, region: Region | None = None) -> bool:
        """The copy is done (``layers``, in ``shared`` or ``region`` if given) or failed (None:
        the lease stays in place).

        Returns whether the lease is still live."""
        with self._lock:
            self._staging.discard(handle)
            ending = self._ending.pop(handle, None)
            if ending is not None:
                request_id, reserved = ending
                self.staged_bytes -= reserved
                self._ended_request_ids.add(request_id)
                for owner in (shared, region):
                    if owner is not None:
                        owner.close()
                return False
            lease = self._leases[handle]
            if layers is None:
                self.staged_bytes -= lease.staged_bytes
                self._leases[handle] = replace(lease, staged_bytes=0)
            else:
                self._leases[handle] = replace(lease, staged=layers, shared=shared, region=region)
                self.num_staged += 1
                self._ended_request_ids.add(lease.request_id)  # the engine's blocks are free now
            return True

    def get(self, handle: str) -> Lease | None:
        """A servable lease: in place or staged, never one whose copy is running."""
        with self._lock:
            return None if handle in self._staging else self._leases.get(handle)

    def mark_pulled(self, handle: str) -> None:
        with self._lock:
            lease = self._leases.get(handle)
            if lease is not None and not lease.pulled:
                self._leases[handle] = replace(lease, pulled=True)

    def release(self, handle: str) -> bool:
        """End a lease early; False when it is unknown or already ended."""
        with self._lock:
            lease = self._leases.pop(handle, None)
            if lease is None:
                return False
            self._end(lease)
            self.num_released += 1
            return True

    def release_all(self) -> int:
        with self._lock:
            handles = list(self._leases)
        return sum(self.release(handle) for handle in handles)

    def expire(self, now: float) -> list[Lease]:
        with self._lock:
            expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
            for lease in expired:
                del self._leases[lease.handle]
                self._end(lease)
                self._expired_handles[lease.handle] = None
            while len(self._expired_handles) > REMEMBERED_EXPIRED_HANDLES:
                self._expired_handles.popitem(last=False)
            self.num_expired += len(expired)
            return expired

    def has_expired(self, handle: str) -> bool:
        """Whether ``handle`` named one of the most recent leases that expired unpulled."""
        with self._lock:
            return handle in self._expired_handles

    def _end(self, lease: Lease) -> None:
        """Caller holds the lock and has removed the lease."""
        if lease.shared is not None:
            lease.shared.close()  # a consumer reading it holds its own descriptor
        if lease.region is not None:
            lease.region.close()  # reused once no READ or send can still reach it
        if lease.handle in self._staging:
            # Reported, and its reservation returned, once the copy stops reading.
            self._ending[lease.handle] = (lease.request_id, lease.staged_bytes)
        elif lease.staged is not None:
            self.staged_bytes -= lease.staged_bytes  # engine blocks were reported when staged
        else:
            self._ended_request_ids.add(lease.request_id)

    def take_ended_request_ids(self) -> set[str]:
        """Request ids whose blocks vLLM may free now; each is returned once."""
        with self._lock:
            ended, self._ended_request_ids = self._ended_request_ids, set()
            return ended

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
