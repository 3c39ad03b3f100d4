"""The circuit breaker's state machine, driven step by step with a fake clock (times are
passed in), and the breakers of a fleet as the completion service feeds them."""

from __future__ import annotations

import logging

import pytest

from orchestrator.circuit_breaker import (
    BreakerSettings,
    BreakerState,
    CircuitBreaker,
    CircuitBreakers,
    counts_against_worker,
)
from orchestrator.worker_client import WorkerError, WorkerTimeout

SETTINGS = BreakerSettings(failure_threshold=3, failure_window_seconds=10.0, cooldown_seconds=5.0)
CLOSED, HALF_OPEN, OPEN = BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN

# (steps as (time, event), expected state at the end, whether a new request may go there)
CASES = {
    "fresh": ([], CLOSED, True),
    "failures below the threshold": ([(0, "failed"), (1, "failed")], CLOSED, True),
    "threshold reached": ([(0, "failed"), (1, "failed"), (2, "failed")], OPEN, False),
    "a success in between resets the count": ([(0, "failed"), (1, "failed"), (2, "succeeded"), (3, "failed"),
                                               (4, "failed")], CLOSED, True),
    "failures outside the window are forgotten": ([(0, "failed"), (1, "failed"), (12, "failed")], CLOSED, True),
    "still open during the cool-down": ([(0, "failed"), (1, "failed"), (2, "failed"), (6.9, "check")], OPEN, False),
    "half-open after the cool-down": ([(0, "failed"), (1, "failed"), (2, "failed"), (7, "check")], HALF_OPEN, True),
    "half-open lets one probe through": ([(0, "failed"), (1, "failed"), (2, "failed"), (7, "dispatched")],
                                         HALF_OPEN, False),
    "the probe's success closes it": ([(0, "failed"), (1, "failed"), (2, "failed"), (7, "dispatched"),
                                       (8, "succeeded")], CLOSED, True),
    "the probe's failure opens it again": ([(0, "failed"), (1, "failed"), (2, "failed"), (7, "dispatched"),
                                            (8, "failed"), (12, "check")], OPEN, False),
    "and the cool-down starts over": ([(0, "failed"), (1, "failed"), (2, "failed"), (7, "dispatched"),
                                       (8, "failed"), (13, "check")], HALF_OPEN, True),
    "a released probe lets another through": ([(0, "failed"), (1, "failed"), (2, "failed"), (7, "dispatched"),
                                               (8, "released")], HALF_OPEN, True),
    "a late success while open is no news": ([(0, "failed"), (1, "failed"), (2, "failed"), (3, "succeeded")],
                                             OPEN, False),
    "failures while open change nothing": ([(0, "failed"), (1, "failed"), (2, "failed"), (6, "failed"),
                                            (7, "check")], HALF_OPEN, True),
    "dispatching while closed probes nothing": ([(0, "dispatched"), (1, "failed")], CLOSED, True),
}


@pytest.mark.parametrize("steps, state, allows", CASES.values(), ids=CASES.keys())
def test_breaker_state_machine(steps, state, allows):
    breaker = CircuitBreaker(SETTINGS)
    now = 0.0
    for now, event in steps:
        if event != "check":
            getattr(breaker, event)(now)
    assert breaker.current(now) is state
    assert breaker.allows(now) is allows


def test_a_threshold_of_one_opens_at_the_first_failure():
    breaker = CircuitBreaker(BreakerSettings(failure_threshold=1))
    breaker.failed(0.0)
    assert breaker.current(0.0) is OPEN


def test_the_threshold_must_be_positive():
    with pytest.raises(ValueError):
        BreakerSettings(failure_threshold=0)


@pytest.mark.parametrize("error, counts", [
    (WorkerError("engine_error", "boom"), True),
    (WorkerTimeout("nothing for 60 s"), True),
    (WorkerError("worker_disconnected", "connection lost"), True),
    (WorkerError("invalid_request", "prompt too long"), False),
    (WorkerError("bad_request", "undecodable"), False),
])
def test_only_the_workers_own_faults_count(error, counts):
    assert counts_against_worker(error) is counts


def test_breakers_are_per_worker_and_log_opening_and_closing(caplog):
    breakers = CircuitBreakers(SETTINGS)
    caplog.set_level(logging.INFO, logger="kvroute.orchestrator.breaker")
    for now in (0, 1, 2):
        breakers.failed("decode-1", now)
    breakers.succeeded("decode-0", 2)
    assert not breakers.allows("decode-1", 3) and breakers.allows("decode-0", 3)
    assert breakers.allows("never-seen", 3)
    assert breakers.states(3) == {"decode-1": OPEN, "decode-0": CLOSED}
    assert "circuit breaker of worker decode-1 opened" in caplog.text
    assert breakers.allows("decode-1", 8)  # half-open: the probe may go
    breakers.dispatched("decode-1", 8)
    breakers.succeeded("decode-1", 9)
    assert "half-open" in caplog.text and "circuit breaker of worker decode-1 closed" in caplog.text
    assert breakers.states(9)["decode-1"] is CLOSED


def test_a_forgotten_worker_starts_closed():
    breakers = CircuitBreakers(BreakerSettings(failure_threshold=1))
    breakers.failed("decode-1", 0)
    breakers.forget("decode-1")
    assert breakers.allows("decode-1", 0) and breakers.states(0) == {}
