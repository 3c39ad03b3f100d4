"""Leases on a producer's finished prompt blocks.

::

    request_finished ──grant──▶ HELD ──release (ack, local hit, abort, rejection)──▶ gone
                                  └────────────expire (deadline passed)───────────▶ gone

While a lease is held vLLM keeps the blocks allocated (the connector returned
``delay_free=True``). Every way out reports the vLLM request id once, so the
scheduler frees the blocks exactly once. Time is passed in; the table holds no clock.
Thread-safe: the block server thread and the engine's step thread both use it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    handle: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    expires_at: float


class LeaseTable:
    """One writer per lease: granted by the engine thread, ended by whoever comes first."""

    def __init__(self):
        self._leases: dict[str, Lease] = {}
        self._ended_request_ids: set[str] = set()
        self._lock = threading.Lock()
        self.num_granted = 0
        self.num_released = 0
        self.num_expired = 0

    def grant(self, lease: Lease) -> None:
        with self._lock:
            self._leases[lease.handle] = lease
            self.num_granted += 1

    def get(self, handle: str) -> Lease | None:
        with self._lock:
            return self._leases.get(handle)

    def release(self, handle: str) -> bool:
        """End a lease early; False when it is unknown or already ended."""
        with self._lock:
            lease = self._leases.pop(handle, None)
            if lease is None:
                return False
            self._ended_request_ids.add(lease.request_id)
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
                self._ended_request_ids.add(lease.request_id)
            self.num_expired += len(expired)
            return expired

    def take_ended_request_ids(self) -> set[str]:
        """Request ids whose blocks vLLM may free now; each is returned once."""
        with self._lock:
            ended, self._ended_request_ids = self._ended_request_ids, set()
            return ended

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
