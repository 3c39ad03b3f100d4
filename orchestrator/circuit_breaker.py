"""Per-worker circuit breakers: a worker that keeps failing requests leaves the rotation.

A worker can stay registered and heartbeating while it fails every request (a broken
engine, a wedged GPU). Migration saves each of those requests, at the price of a failed
attempt first; the breaker stops sending them there at all::

    CLOSED ── failure_threshold consecutive failures within failure_window ──▶ OPEN
      ▲                                                                         │
      │ the probe succeeds                                     cooldown passed  │
      │                                                                         ▼
      └──────────────────────────── HALF_OPEN ◀─────────────────────────────────┘
                                    one request (the probe) goes through;
                                    its failure opens the breaker again

A success in CLOSED clears the failures: only consecutive ones count. A request that
ends without a verdict (the client left, another worker failed) releases the probe.
No clock inside: ``now`` (monotonic seconds) is passed in. Single writer: the
orchestrator's event loop (the fleet asks, the completion service reports).
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field

from orchestrator.queue_patience import QUEUE_TIMEOUT_CODE
from orchestrator.worker_client import WorkerError

logger = logging.getLogger("kvroute.orchestrator.breaker")

# Error codes that are the request's fault, not the worker's: every worker would say the same.
REQUEST_FAULT_CODES = frozenset({"bad_request", "invalid_request", "duplicate"})
# A worker that is draining refuses new requests on purpose; it is leaving, not failing.
DRAINING_CODE = "draining"


def counts_against_worker(error: WorkerError) -> bool:
    """A queue timeout does not count either: the worker was working through its queue."""
    return error.code not in REQUEST_FAULT_CODES and error.code not in (DRAINING_CODE, QUEUE_TIMEOUT_CODE)


class BreakerState(enum.Enum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass(frozen=True)
class BreakerSettings:
    failure_threshold: int = 5  # consecutive failures that open the breaker
    failure_window_seconds: float = 30.0  # failures older than this are forgotten
    cooldown_seconds: float = 10.0  # open this long before a probe request may go through

    def __post_init__(self):
        if self.failure_threshold < 1:
            raise ValueError("the breaker's failure threshold must be at least 1")


@dataclass
class CircuitBreaker:
    """One worker's breaker; see the module docstring for the states."""

    settings: BreakerSettings
    state: BreakerState = BreakerState.CLOSED
    opened_at: float = 0.0
    probing: bool = False  # HALF_OPEN: the probe request is out
    _failures: deque[float] = field(default_factory=deque)

    def current(self, now: float) -> BreakerState:
        """The state at ``now``: an open breaker whose cool-down passed is half-open."""
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.settings.cooldown_seconds:
            self.state, self.probing = BreakerState.HALF_OPEN, False
        return self.state

    def allows(self, now: float) -> bool:
        """May a new request be planned onto this worker?"""
        state = self.current(now)
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self.probing)

    def dispatched(self, now: float) -> None:
        if self.current(now) is BreakerState.HALF_OPEN:
            self.probing = True

    def succeeded(self, now: float) -> None:
        # A success in OPEN is a request that started before the breaker opened: no news.
        if self.current(now) is not BreakerState.OPEN:
            self.state, self.probing = BreakerState.CLOSED, False
            self._failures.clear()

    def failed(self, now: float) -> None:
        state = self.current(now)
        if state is BreakerState.HALF_OPEN:
            self._open(now)
        elif state is BreakerState.CLOSED:
            self._failures.append(now)
            while now - self._failures[0] > self.settings.failure_window_seconds:
                self._failures.popleft()
            if len(self._failures) >= self.settings.failure_threshold:
                self._open(now)

    def released(self, now: float) -> None:
        """The request ended without saying anything about this worker's health."""
        if self.current(now) is BreakerState.HALF_OPEN:
            self.probing = False

    def _open(self, now: float) -> None:
        self.state, self.opened_at, self.probing = BreakerState.OPEN, now, False
        self._failures.clear()


class CircuitBreakers:
    """The fleet's breakers by worker id, made on first mention; logs every transition."""

    def __init__(self, settings: BreakerSettings):
        self.settings = settings
        self._breakers: dict[str, CircuitBreaker] = {}

    def allows(self, worker_id: str, now: float) -> bool:
        breaker = self._breakers.get(worker_id)
        return breaker is None or self._observed(worker_id, breaker, breaker.allows, now)

    def dispatched(self, worker_id: str, now: float) -> None:
        self._report(worker_id, CircuitBreaker.dispatched, now)

    def succeeded(self, worker_id: str, now: float) -> None:
        self._report(worker_id, CircuitBreaker.succeeded, now)

    def failed(self, worker_id: str, now: float) -> None:
        self._report(worker_id, CircuitBreaker.failed, now)

    def released(self, worker_id: str, now: float) -> None:
        self._report(worker_id, CircuitBreaker.released, now)

    def forget(self, worker_id: str) -> None:
        """The worker is gone; a new incarnation starts with a closed breaker."""
        self._breakers.pop(worker_id, None)

    def retain(self, worker_ids: set[str]) -> None:
        """Forget every breaker but those of ``worker_ids`` (the registered workers)."""
        for worker_id in set(self._breakers) - worker_ids:
            del self._breakers[worker_id]

    def states(self, now: float) -> dict[str, BreakerState]:
        return {worker_id: self._observed(worker_id, breaker, breaker.current, now)
                for worker_id, breaker in self._breakers.items()}

    def _report(self, worker_id: str, event, now: float) -> None:
        breaker = self._breakers.setdefault(worker_id, CircuitBreaker(self.settings))
        self._observed(worker_id, breaker, lambda at: event(breaker, at), now)

    def _observed(self, worker_id: str, breaker: CircuitBreaker, action, now: float):
        before = breaker.state
        result = action(now)
        if breaker.state is not before:
            _log_transition(worker_id, before, breaker.state, self.settings)
        return result


def _log_transition(worker_id: str, before: BreakerState, after: BreakerState, settings: BreakerSettings) -> None:
    if after is BreakerState.OPEN:
        logger.warning("circuit breaker of worker %s opened (%s): out of rotation for %.0f s", worker_id,
                       "its probe request failed" if before is BreakerState.HALF_OPEN else
                       f"{settings.failure_threshold} consecutive failures", settings.cooldown_seconds)
    elif after is BreakerState.HALF_OPEN:
        logger.info("circuit breaker of worker %s half-open: letting one probe request through", worker_id)
    else:
        logger.info("circuit breaker of worker %s closed: back in rotation", worker_id)
