"""Ending a simulation once its verdict is settled (``simulator.stopping``): which requests
are certain to miss their SLO, and that a stopped run never changes a goodput verdict."""

from __future__ import annotations

import pytest

from kvroute.bench.peers.report import Targets
from kvroute.bench.shapes.goodput import attainment
from simulator import simulate
from simulator.flight import PENDING, RUNNING, Flight
from simulator.records import FINISHED, REJECTED
from simulator.requests import TokenRequest
from simulator.stopping import SloMissBudget, certain_miss

TTFT, TPOT = 1.0, 0.1
TARGETS = Targets(ttft_s=TTFT, tpot_s=TPOT)


def flight(status=RUNNING, first=None, last=None, max_tokens=11) -> Flight:
    request = TokenRequest(0, 10.0, max_tokens, [1, 2, 3])
    return Flight(request, "r", None, [], 3, admit_by=20.0, status=status, first_token_at=first, last_token_at=last)


@pytest.mark.parametrize("made, now, missed", [
    (flight(status=REJECTED), 10.0, True),
    (flight(status=PENDING), 11.4, False),  # the target passed, but within the step margin
    (flight(status=PENDING), 11.6, True),
    (flight(first=10.5, last=10.5), 30.0, False),  # one token out: the rest may still come on time
    (flight(first=11.2, last=11.2), 11.2, True),  # TTFT 1.2 s
    (flight(first=10.5, last=11.4), 11.4, False),  # 0.9 s for what may be 10 tokens: 90 ms
    (flight(first=10.5, last=11.6), 11.6, True),  # already 110 ms a token, however many follow
    (flight(status=FINISHED, first=10.5, last=11.0, max_tokens=1), 11.0, False),
])
def test_a_request_is_a_certain_miss_only_when_no_future_can_save_it(made, now, missed):
    assert certain_miss(made, now, TTFT, TPOT) is missed


def test_the_budget_settles_once_the_bar_is_out_of_reach():
    budget = SloMissBudget(TTFT, TPOT, total=10, bar=0.9)
    assert not budget.settled([flight(status=REJECTED)], 10.0) and budget.best_possible == 0.9
    assert budget.settled([flight(status=REJECTED)] * 2, 10.0) and budget.best_possible == 0.8


def burst(count: int, spacing: float, max_tokens: int = 32) -> list[TokenRequest]:
    """Distinct 600-token prompts, ``spacing`` s apart."""
    return [TokenRequest(i, i * spacing, max_tokens, [1000 * i + t for t in range(600)]) for i in range(count)]


def test_an_overloaded_run_stops_early_with_the_same_verdict():
    requests = burst(200, 0.02)
    full = simulate(requests, "round_robin", 0, 0, num_unified=1)
    budget = SloMissBudget(TTFT, TPOT, len(requests), 0.9, check_every=10)
    stopped = simulate(requests, "round_robin", 0, 0, num_unified=1, stop=budget)
    assert stopped.stopped_early and not full.stopped_early
    assert stopped.events < full.events / 2
    assert attainment(full.records, TARGETS) <= budget.best_possible < 0.9


def test_a_run_within_its_slo_runs_to_the_end_unchanged():
    requests = burst(6, 3.0)
    plain = simulate(requests, "round_robin", 0, 0, num_unified=1)
    watched = simulate(requests, "round_robin", 0, 0, num_unified=1,
                       stop=SloMissBudget(TTFT, TPOT, len(requests), 0.9, check_every=1))
    assert not watched.stopped_early and attainment(plain.records, TARGETS) >= 0.9
    assert watched.records == plain.records
