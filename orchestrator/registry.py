"""Which workers exist, whether they are alive, and how loaded they say they are.

Mechanism only: ``observe`` a heartbeat, ``expire`` silent workers, list ``live`` ones.
No socket and no clock inside; ``now`` is passed in. A worker is identified by its
id; a new incarnation id under the same id means the process restarted, and replaces
the old entry (the caller purges anything keyed by the old incarnation).

A heartbeat is refused, and changes nothing, when its fields are malformed
(``foundation.heartbeat_checks``: an address no socket may connect to, say), when its
model differs from ours, or when it names a new worker while ``max_workers`` are
registered. A refusal's ``reason`` goes back to the sender, so it never carries the
orchestrator's model fingerprint (that would tell anyone what to claim); ``detail``
carries it for this orchestrator's own log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

from foundation import wire
from foundation.heartbeat_checks import heartbeat_problem

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
    node_store_address: str = ""  # its host's node KV store; "" for none

    @property
    def node_store(self) -> tuple[str, str] | None:
        """Which node store it uses (``node_store_key``); None: none."""
        if not self.node_store_address:
            return None
        return node_store_key(self.rpc_address, self.node_store_address)


def node_store_key(rpc_address: str, store_address: str) -> tuple[str, str]:
    """A node store as (the host of a worker using it, the store's address there). Store
    addresses are loopback or ipc, so only the host tells two stores apart."""
    return urlsplit(rpc_address).hostname or "", store_address


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str = ""
    is_new: bool = False  # first heartbeat of this incarnation
    replaced: WorkerView | None = None  # the previous incarnation, if the worker restarted
    detail: str = ""  # for this orchestrator's log only, never sent: what the reason leaves out


class WorkerRegistry:
    """Single writer: the registry endpoint's task."""

    def __init__(self, model_fingerprint: str, heartbeat_timeout: float, max_workers: int = 1024):
        self.model_fingerprint = model_fingerprint
        self.heartbeat_timeout = heartbeat_timeout
        self.max_workers = max_workers
        self._workers: dict[str, WorkerView] = {}

    def observe(self, beat: wire.Heartbeat, now: float) -> Verdict:
        refusal = self._refusal(beat)
        if refusal is not None:
            return refusal
        previous = self._workers.get(beat.worker_id)
        self._workers[beat.worker_id] = WorkerView(beat.worker_id, beat.role, beat.incarnation, beat.rpc_address,
                                                   beat.load, now, beat.kv_events_address, beat.draining,
                                                   beat.transfer_address, beat.prefill_probe, beat.cores,
                                                   beat.node_store_address)
        if previous is not None and previous.incarnation == beat.incarnation:
            if beat.draining and not previous.draining:
                logger.info("worker %s is draining: no new requests go there", beat.worker_id)
            return Verdict(True)
        replaced = previous if previous is not None else None
        logger.info("worker %s (%s) %s at %s", beat.worker_id, beat.role,
                    "restarted" if replaced else "registered", beat.rpc_address)
        return Verdict(True, is_new=True, replaced=replaced)

    def _refusal(self, beat: wire.Heartbeat) -> Verdict | None:
        problem = heartbeat_problem(beat)
        if problem is not None:
            return Verdict(False, f"malformed heartbeat: {problem}")
        if beat.model_fingerprint != self.model_fingerprint:
            claimed = beat.model_fingerprint[:64] or "missing"
            return Verdict(False, "the worker's model or tokenizer does not match the orchestrator's; reusing KV "
                                  "across model releases would be incorrect",
                           detail=f"worker fingerprint {claimed!r}, orchestrator's {self.model_fingerprint!r}")
        if beat.worker_id not in self._workers and len(self._workers) >= self.max_workers:
            return Verdict(False, f"the fleet is full ({self.max_workers} workers registered)")
        return None

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
