"""Reconciling a worker's last heartbeat with what this orchestrator did since.

A heartbeat is up to a second old when the planner reads it. A request that finished
its prefill a moment ago still shows in it as waiting, with its prompt still queued;
one sent a moment ago does not show yet. Both mislead the queue-wait estimate, and a
warm worker looks busy right after serving the request that warmed it.

The ledger remembers, per worker, the prefills this orchestrator has sent and not yet
seen finish, and those it saw finish since the worker's last heartbeat. A worker that
lists its queued prompts by request id (what each still has to compute, which shrinks
as its prefill is scheduled and counts what its cache already holds) is read exactly::

    queued = the heartbeat's requests, less those seen finished since it
             + own pending requests the heartbeat does not list yet

and one that reports only a total, as well as it can::

    queued = max(own pending, heartbeat's queued - own finished since that heartbeat)

The heartbeat still counts work that other orchestrator replicas sent, so it is never
ignored; what this orchestrator knows better replaces the stale part.

Decode room is corrected the same way: blocks reserved for requests sent since the
heartbeat are taken off its free count, and blocks of requests that finished since it
(and were already counted there) are given back::

    free = heartbeat's free - reserved since that heartbeat + released since it

and so is the count of running requests, which prices the slowdown a LOCAL prefill
imposes on a decode worker (a request that ended a moment ago made a cold decode worker
look busy enough to lose a plan it should have won)::

    running = heartbeat's running - requests it counted that ended since it

How long the oldest queued prompt has been computing matters as much as its size: vLLM
gives a prompt alone the whole step, so a lone cold prompt is one long engine step whose
progress no listing shows until it ends. The worker reports the age of its oldest
prompt's current step (``WorkerLoad.head_prompt_age``); where that prompt finished since
the heartbeat, or the heartbeat did not list it yet, the ledger dates the new oldest
prompt from the later of its dispatch and the last prefill it saw end there.

Pure: no clock (callers pass the time), no socket. Single writer: the orchestrator's event loop (the service
records dispatches and finished prefills, the fleet records heartbeats).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class QueuedWork:
    num_waiting: int
    num_queued_prefill_tokens: int
    # request id -> tokens, where the worker lists them; from ``LoadLedger.queued``, with
    # what this orchestrator knows better applied (finished ones gone, pending ones added)
    per_request: Mapping[str, int] | None = None
    # Seconds the oldest prompt of ``per_request`` has computed without its listed tokens
    # changing (reported: at the heartbeat, plus the heartbeat's age).
    head_age: float = 0.0


@dataclass
class _Reservation:
    blocks: int
    in_heartbeat: bool = False  # a heartbeat arrived after the request was sent


@dataclass
class _WorkerLedger:
    pending: dict[str, int] = field(default_factory=dict)  # request id -> prefill tokens
    dispatched_at: dict[str, float] = field(default_factory=dict)  # of pending requests
    last_prefilled_at: float = float("-inf")  # when a prefill last ended there
    finished: dict[str, int] = field(default_factory=dict)  # since the last heartbeat: request id -> tokens
    reservations: dict[str, _Reservation] = field(default_factory=dict)  # request id -> decode blocks
    released_blocks: int = 0  # since the last heartbeat, of reservations it had counted
    released_requests: int = 0  # how many such reservations


class LoadLedger:
    def __init__(self):
        self._workers: dict[str, _WorkerLedger] = {}

    def dispatched(self, worker_id: str, request_id: str, prefill_tokens: int, now: float) -> None:
        """``worker_id`` was just asked to prefill ``prefill_tokens`` for ``request_id``."""
        ledger = self._ledger(worker_id)
        ledger.pending[request_id] = max(0, prefill_tokens)
        ledger.dispatched_at[request_id] = now

    def prefilled(self, worker_id: str, request_id: str, now: float) -> None:
        """The request's prefill on ``worker_id`` is over (its first token arrived, or it ended)."""
        ledger = self._workers.get(worker_id)
        if ledger is None or request_id not in ledger.pending:
            return
        ledger.finished[request_id] = ledger.pending.pop(request_id)
        del ledger.dispatched_at[request_id]
        ledger.last_prefilled_at = now

    def reserved(self, worker_id: str, request_id: str, blocks: int) -> None:
        """``worker_id`` will hold up to ``blocks`` KV blocks for ``request_id`` while it decodes."""
        self._ledger(worker_id).reservations[request_id] = _Reservation(max(0, blocks))

    def released(self, worker_id: str, request_id: str) -> None:
        """The request ended on ``worker_id``; vLLM freed its blocks."""
        ledger = self._workers.get(worker_id)
        reservation = ledger.reservations.pop(request_id, None) if ledger else None
        if reservation is not None and reservation.in_heartbeat:
            ledger.released_blocks += reservation.blocks
            ledger.released_requests += 1

    def heartbeat(self, worker_id: str) -> None:
        """A fresh report from the worker already accounts for everything before it."""
        ledger = self._workers.get(worker_id)
        if ledger is not None:
            ledger.finished.clear()
            ledger.released_blocks = 0
            ledger.released_requests = 0
            for reservation in ledger.reservations.values():
                reservation.in_heartbeat = True

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def retain(self, worker_ids: set[str]) -> None:
        """Forget every worker but ``worker_ids`` (the registered ones)."""
        for worker_id in set(self._workers) - worker_ids:
            del self._workers[worker_id]

    def heartbeat_is_current(self, worker_id: str) -> bool:
        """Nothing this orchestrator saw since the worker's last heartbeat changes its
        queue or its running count: its heartbeat is read as it is."""
        ledger = self._workers.get(worker_id)
        return ledger is None or not (ledger.pending or ledger.finished or ledger.released_requests)

    def queued(self, worker_id: str, reported: QueuedWork, now: float) -> QueuedWork:
        if self.heartbeat_is_current(worker_id):
            return reported
        ledger = self._workers[worker_id]
        num_waiting = max(len(ledger.pending), reported.num_waiting - len(ledger.finished))
        listed = reported.per_request
        if listed is None:
            tokens = max(sum(ledger.pending.values()),
                         reported.num_queued_prefill_tokens - sum(ledger.finished.values()))
            return QueuedWork(num_waiting=num_waiting, num_queued_prefill_tokens=tokens)
        queued = {request_id: left for request_id, left in listed.items() if request_id not in ledger.finished}
        queued.update((request_id, left) for request_id, left in ledger.pending.items() if request_id not in listed)
        return QueuedWork(num_waiting=num_waiting, num_queued_prefill_tokens=sum(queued.values()),
                          per_request=queued, head_age=_head_age(ledger, listed, queued, reported.head_age, now))

    def free_blocks(self, worker_id: str, reported_free: int, total: int) -> int:
        ledger = self._workers.get(worker_id)
        if ledger is None:
            return reported_free
        unreported = sum(r.blocks for r in ledger.reservations.values() if not r.in_heartbeat)
        return max(0, min(total, reported_free - unreported + ledger.released_blocks))

    def running(self, worker_id: str, reported_running: int) -> int:
        ledger = self._workers.get(worker_id)
        if ledger is None:
            return reported_running
        return max(0, reported_running - ledger.released_requests)

    def _ledger(self, worker_id: str) -> _WorkerLedger:
        return self._workers.setdefault(worker_id, _WorkerLedger())


def _head_age(ledger: _WorkerLedger, listed: Mapping[str, int], queued: Mapping[str, int], reported_age: float,
              now: float) -> float:
    """How long the oldest of ``queued`` has been computing: as reported, if the heartbeat
    listed it first; else since the later of its dispatch and the last prefill that ended
    on the worker (which is when an engine serving prompts in turn started it)."""
    head = next(iter(queued), None)
    if head is None:
        return 0.0
    if head == next(iter(listed), None):
        return reported_age
    started = max(ledger.dispatched_at.get(head, float("-inf")), ledger.last_prefilled_at)
    return max(0.0, now - started) if started > float("-inf") else 0.0
