"""Which workers exist, whether they are alive, and how loaded they say they are.

Mechanism only: ``observe`` a heartbeat, ``expire`` silent workers, list ``live`` ones.
No socket and no clock inside; ``now`` is passed in. A worker is identified by its
id; a new incarnation id under the same id means the process restarted, and replaces
the old entry (the caller purges anything keyed by the old incarnation).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from foundation import wire

logger = logging.getLogger("kvroute.orchestrator.registry")


@dataclass(frozen=True)
class WorkerView:
    """An immutable snapshot of one worker, as planners and the API see it."""

    worker_id: str
    role: str
    incarnation: str
    rpc_address: str
    load: wire.WorkerLoad
    last_seen: float
    kv_events_address: str = ""
    draining: bool = False  # told to stop: finishing its requests, taking no new ones
    transfer_address: str = ""
    prefill_probe: wire.PrefillProbe | None = None  # its start-up prefill timing
    cores: wire.CoreBinding | None = None  # the CPU cores its engine computes on, if bound


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str = ""
    is_new: bool = False  # first heartbeat of this incarnation
    replaced: WorkerView | None = None  # the previous incarnation, if the worker restarted


class WorkerRegistry:
    """Single writer: the registry endpoint's task."""

    def __init__(self, model_fingerprint: str, heartbeat_timeout: float):
        self.model_fingerprint = model_fingerprint
        self.heartbeat_timeout = heartbeat_timeout
        self._workers: dict[str, WorkerView] = {}

    def observe(self, beat: wire.Heartbeat, now: float) -> Verdict:
        if beat.model_fingerprint != self.model_fingerprint:
            return Verdict(False, f"model/tokenizer fingerprint {beat.model_fingerprint or 'missing'} differs "
                                  f"from the orchestrator's {self.model_fingerprint}; reusing KV across model "
                                  f"releases would be incorrect")
        if beat.role not in wire.ROLES:
            return Verdict(False, f"unknown role {beat.role!r}")
        previous = self._workers.get(beat.worker_id)
        self._workers[beat.worker_id] = WorkerView(beat.worker_id, beat.role, beat.incarnation, beat.rpc_address,
                                                   beat.load, now, beat.kv_events_address, beat.draining,
                                                   beat.transfer_address, beat.prefill_probe, beat.cores)
        if previous is not None and previous.incarnation == beat.incarnation:
            if beat.draining and not previous.draining:
                logger.info("worker %s is draining: no new requests go there", beat.worker_id)
            return Verdict(True)
        replaced = previous if previous is not None else None
        logger.info("worker %s (%s) %s at %s", beat.worker_id, beat.role,
                    "restarted" if replaced else "registered", beat.rpc_address)
        return Verdict(True, is_new=True, replaced=replaced)

    def expire(self, now: float) -> list[WorkerView]:
        """Remove and return workers whose last heartbeat is too old."""
        dead = [w for w in self._workers.values() if now - w.last_seen > self.heartbeat_timeout]
        for worker in dead:
            del self._workers[worker.worker_id]
            logger.warning("worker %s missed heartbeats for %.1f s; marked down",
                           worker.worker_id, now - worker.last_seen)
        return dead

    def remove(self, worker_id: str) -> WorkerView | None:
        return self._workers.pop(worker_id, None)

    def live(self, role: str | None = None) -> list[WorkerView]:
        return [w for w in self._workers.values() if role is None or w.role == role]

    def get(self, worker_id: str) -> WorkerView | None:
        return self._workers.get(worker_id)
