"""Goodput from simulated runs: which requests meet the SLO, and the largest rate at which
enough of them do. Pure functions; the simulation is passed in as a function of the rate.

* A simulated request **meets the SLO** as ``kvroute bench peers`` judges a real one
  (``peers.report.meets_slo``): it finished, its TTFT is within the TTFT target and its
  TPOT, (last − first token) / (tokens − 1), within the TPOT target (a one-token answer is
  judged on TTFT alone); a rejected request counts against it.
* A run that can no longer reach the bar (more requests certain to miss than it allows) is
  stopped there (``simulator.stopping``): the verdict is the same, at a fraction of the cost
  of an overloaded run's draining backlog.
* **Goodput** is the largest rate whose run has at least ``Targets.attainment`` (90%) of its
  requests within both targets. ``search`` raises the rate by ``growth`` from ``start``
  until a run falls short (or ``max_rate``), then bisects between the last rate that met
  the bar and the first that did not, ``refinements`` times. It assumes attainment falls
  as the rate rises: a shape that passed a rate above one it failed is not looked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvroute.bench.peers.report import Targets
from simulator.records import FINISHED, RequestRecord

GROWTH = 1.25  # a failing probe overloads by at most this: overloaded runs are the slow ones
REFINEMENTS = 3


def tpot_seconds(record: RequestRecord) -> float | None:
    """(last − first token) / (tokens − 1); None for a one-token answer."""
    if record.output_tokens < 2:
        return None
    return (record.e2e_seconds - record.ttft_seconds) / (record.output_tokens - 1)


def meets_slo(record: RequestRecord, targets: Targets) -> bool:
    if record.status != FINISHED or record.ttft_seconds > targets.ttft_s:
        return False
    tpot = tpot_seconds(record)
    return tpot is None or tpot <= targets.tpot_s


def attainment(records: Iterable[RequestRecord], targets: Targets) -> float:
    """The share of ``records`` that met the SLO (0 for none)."""
    records = list(records)
    return sum(meets_slo(record, targets) for record in records) / len(records) if records else 0.0


@dataclass
class Sweep:
    """The rates a search ran, with each run's attainment, and the goodput they give."""

    bar: float
    probes: dict[float, float] = field(default_factory=dict)  # rate → attainment
    # Rates whose run stopped once it could no longer reach the bar (``simulator.stopping``):
    # their attainment is the most the run could still have reached, below the bar.
    stopped_early: set[float] = field(default_factory=set)

    def passes(self, rate: float) -> bool:
        return self.probes[rate] >= self.bar

    @property
    def goodput(self) -> float | None:
        """The largest probed rate that met the bar; None when none did."""
        passing = [rate for rate in self.probes if self.passes(rate)]
        return max(passing) if passing else None


@dataclass(frozen=True)
class Probe:
    """One run's attainment; ``stopped_early``: the most it could still have reached."""

    attainment: float
    stopped_early: bool = False


def search(attain: Callable[[float], Probe], start: float, bar: float, max_rate: float = float("inf"),
           growth: float = GROWTH, refinements: int = REFINEMENTS) -> Sweep:
    """The goodput of the system whose run at rate r gives ``attain(r)`` (see the module docstring).
    From ``start`` down by ``growth`` while even ``start`` falls short (at most ``refinements`` + 3 times)."""
    if start <= 0 or growth <= 1:
        raise ValueError("start must be positive and growth above 1")
    sweep = Sweep(bar)

    def probe(rate: float) -> bool:
        result = attain(rate)
        sweep.probes[rate] = result.attainment
        if result.stopped_early:
            sweep.stopped_early.add(rate)
        return sweep.passes(rate)

    low, high, rate = None, None, start
    while probe(rate) and rate < max_rate:
        low, rate = rate, min(rate * growth, max_rate)
    if not sweep.passes(rate):
        high = rate
    for _ in range(refinements + 3 if low is None else 0):  # even the start fell short: go down
        rate /= growth
        if probe(rate):
            low = rate
            break
        high = rate
    if low is None or high is None:
        return sweep
    for _ in range(refinements):
        middle = (low + high) / 2
        low, high = (middle, high) if probe(middle) else (low, middle)
    return sweep
