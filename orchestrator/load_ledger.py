"""Reconciling a worker's last heartbeat with what this orchestrator did since.

A heartbeat is up to a second old when the planner reads it. A request that finished
its prefill a moment ago still shows in it as waiting, with its prompt still queued;
one sent a moment ago does not show yet. Both mislead the queue-wait estimate, and a
warm worker looks busy right after serving the request that warmed it.

The ledger remembers, per worker, the prefills this orchestrator has sent and not yet
seen finish, and those it saw finish since the worker's last heartbeat::

    queued = max(own pending, heartbeat's queued - own finished since that heartbeat)

The heartbeat still counts work that other orchestrator replicas sent, so it is never
ignored; what this orchestrator knows better replaces the stale part.

Pure: no clock, no socket. Single writer: the orchestrator's event loop (the service
records dispatches and finished prefills, the fleet records heartbeats).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class QueuedWork:
    num_waiting: int
    num_queued_prefill_tokens: int


@dataclass
class _WorkerLedger:
    pending: dict[str, int] = field(default_factory=dict)  # request id -> prefill tokens
    finished_requests: int = 0  # since the last heartbeat
    finished_tokens: int = 0


class LoadLedger:
    def __init__(self):
        self._workers: dict[str, _WorkerLedger] = {}

    def dispatched(self, worker_id: str, request_id: str, prefill_tokens: int) -> None:
        """``worker_id`` was just asked to prefill ``prefill_tokens`` for ``request_id``."""
        self._ledger(worker_id).pending[request_id] = max(0, prefill_tokens)

    def prefilled(self, worker_id: str, request_id: str) -> None:
        """The request's prefill on ``worker_id`` is over (its first token arrived, or it ended)."""
        ledger = self._workers.get(worker_id)
        if ledger is None or request_id not in ledger.pending:
            return
        ledger.finished_requests += 1
        ledger.finished_tokens += ledger.pending.pop(request_id)

    def heartbeat(self, worker_id: str) -> None:
        """A fresh report from the worker already accounts for every prefill finished before it."""
        ledger = self._workers.get(worker_id)
        if ledger is not None:
            ledger.finished_requests = ledger.finished_tokens = 0

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def queued(self, worker_id: str, reported: QueuedWork) -> QueuedWork:
        ledger = self._workers.get(worker_id)
        if ledger is None:
            return reported
        return QueuedWork(
            num_waiting=max(len(ledger.pending), reported.num_waiting - ledger.finished_requests),
            num_queued_prefill_tokens=max(sum(ledger.pending.values()),
                                          reported.num_queued_prefill_tokens - ledger.finished_tokens))

    def _ledger(self, worker_id: str) -> _WorkerLedger:
        return self._workers.setdefault(worker_id, _WorkerLedger())
