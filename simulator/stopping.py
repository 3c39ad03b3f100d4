"""Ending a simulation once its verdict is settled: a goodput search only asks whether a run
kept enough requests within their SLO, and an overloaded run settles that long before its
backlog drains (the slowest part of a search: every waiting request re-plans every 0.25 s).

A rule is asked every ``check_every`` events (its own) whether the run can stop
(``EventQueue.run``). ``SloMissBudget`` stops it once more requests are *certain* to miss
their SLO than the attainment bar allows. A request is certain to miss when:

* it was rejected;
* its first token came later than the TTFT target, or has not come although the target
  passed more than ``TTFT_MARGIN_SECONDS`` ago (the margin covers a step whose tokens are
  reported at its end, after the clock moved past them);
* its tokens after the first already took longer than the TPOT target allows for all the
  tokens it may produce: (last token − first) / (max_tokens − 1) > target can only grow.

So a stopped run's attainment is at most ``best_possible`` (below the bar); a run that is
not stopped is judged on its records as before.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from simulator.flight import Flight
from simulator.records import REJECTED

CHECK_EVERY_EVENTS = 2_000
TTFT_MARGIN_SECONDS = 0.5


class StopRule(Protocol):
    check_every: int  # events between two questions

    def settled(self, flights: Collection[Flight], now: float) -> bool:
        """Whether the run's verdict is known, given the flights that arrived by ``now``."""


def certain_miss(flight: Flight, now: float, ttft_s: float, tpot_s: float) -> bool:
    """Whether ``flight`` can no longer meet TTFT <= ``ttft_s`` and TPOT <= ``tpot_s``."""
    if flight.status == REJECTED:
        return True
    arrival = flight.request.arrival_seconds
    if flight.first_token_at is None:
        return now - arrival > ttft_s + TTFT_MARGIN_SECONDS
    if flight.first_token_at - arrival > ttft_s:
        return True
    max_tokens = flight.request.max_tokens
    if max_tokens < 2 or flight.last_token_at is None:
        return False
    return (flight.last_token_at - flight.first_token_at) / (max_tokens - 1) > tpot_s


@dataclass
class SloMissBudget:
    """Stop once ``total`` requests can no longer reach ``bar`` within both targets."""

    ttft_s: float
    tpot_s: float
    total: int
    bar: float
    check_every: int = CHECK_EVERY_EVENTS
    misses: int = 0  # at the last check

    def settled(self, flights: Collection[Flight], now: float) -> bool:
        self.misses = sum(certain_miss(flight, now, self.ttft_s, self.tpot_s) for flight in flights)
        return self.best_possible < self.bar

    @property
    def best_possible(self) -> float:
        """The most the run can still attain: every request not yet a certain miss meets its SLO."""
        return (self.total - self.misses) / self.total if self.total else 0.0
