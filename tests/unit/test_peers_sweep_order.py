"""The sweep's start, run and stop order, with stand-ins for the systems and the replay:
interleaved keeps every system up and alternates them run by run; sequential starts each only
after the one before has stopped; a system that fails to start or to replay is recorded as not
run and the others go on."""

from __future__ import annotations

import contextlib

import pytest
from rich.console import Console

from kvroute.bench.peers import report, run, sources
from kvroute.bench.peers.plans import RESET_ENGINES, Plan
from kvroute.bench.peers.systems import SystemStartError
from kvroute.bench.replay_server import ReplayError

TARGETS = report.Targets()


class FakeSystem:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.url = plan.url


@pytest.fixture
def events(monkeypatch):
    happened: list[tuple] = []
    broken = {"start": set(), "replay": set()}

    @contextlib.contextmanager
    def running(plan, log_dir, start_timeout):
        if plan.system in broken["start"]:
            raise SystemStartError(f"{plan.system} exited while starting")
        happened.append(("start", plan.system))
        try:
            yield FakeSystem(plan)
        finally:
            happened.append(("stop", plan.system))

    def measure_run(system, target, workload, rate, items, lengths, settings, console):
        if system.plan.system in broken["replay"]:
            raise ReplayError("connection refused")
        happened.append(("run", system.plan.system, rate))
        metrics = report.run_metrics([], 1.0, settings.targets)
        return run.RunRecord(system.plan.system, workload, rate, [], metrics, {"reset": True}, by_repeat=(metrics,))

    monkeypatch.setattr(run, "running", running)
    monkeypatch.setattr(run, "measure_run", measure_run)
    monkeypatch.setattr(run, "_target", lambda system, timeout: None)
    monkeypatch.setattr(run, "warm_up", lambda target, settings, label: None)
    monkeypatch.setattr(run, "build_workloads", lambda settings: {
        ("long-output", rate): ([], {}, {}) for rate in settings.rates})
    return happened, broken


def plans(*names: str) -> list[Plan]:
    return [Plan(name, "http://127.0.0.1:1", (), RESET_ENGINES) for name in names]


def settings(**kwargs) -> run.SweepSettings:
    return run.SweepSettings(("long-output",), (0.5, 1.0), sources.SourceSettings(2), TARGETS, **kwargs)


def sweep(systems, **kwargs):
    return run.sweep(systems, settings(**kwargs), None, Console(quiet=True))


def test_interleaved_keeps_all_up_and_reverses_the_order_every_other_run(events):
    happened, _ = events
    result = sweep(plans("a", "b", "c"), repeats=2)
    assert happened[:3] == [("start", "a"), ("start", "b"), ("start", "c")]
    runs = [event[1:] for event in happened if event[0] == "run"]
    assert runs == [("a", 0.5), ("b", 0.5), ("c", 0.5), ("c", 0.5), ("b", 0.5), ("a", 0.5),
                    ("a", 1.0), ("b", 1.0), ("c", 1.0), ("c", 1.0), ("b", 1.0), ("a", 1.0)]
    assert sorted(happened[-3:]) == [("stop", "a"), ("stop", "b"), ("stop", "c")]
    assert all([r.repeats for r in record.runs] == [2, 2] for record in result.systems)
    assert all([len(r.by_repeat) for r in record.runs] == [2, 2] for record in result.systems)
    assert set(result.metrics_by_round()["a"]["long-output"]) == {0.5, 1.0}


def test_sequential_starts_each_system_after_the_last_stopped(events):
    happened, _ = events
    sweep(plans("a", "b"), sequential=True)
    assert happened == [("start", "a"), ("run", "a", 0.5), ("run", "a", 1.0), ("stop", "a"),
                        ("start", "b"), ("run", "b", 0.5), ("run", "b", 1.0), ("stop", "b")]


def test_a_system_that_fails_is_recorded_and_the_others_go_on(events):
    happened, broken = events
    broken["start"].add("a")
    broken["replay"].add("b")
    result = sweep(plans("a", "b", "c"))
    skipped = {record.system: record.skipped for record in result.systems}
    assert skipped["a"].startswith("did not run: a exited") and skipped["b"] == "did not run: connection refused"
    assert skipped["c"] is None and [r.rate for r in result.systems[2].runs] == [0.5, 1.0]
    assert [event for event in happened if event[0] == "run"] == [("run", "c", 0.5), ("run", "c", 1.0)]
    assert ("stop", "b") in happened  # a system whose replay broke is still stopped


def test_repeats_must_be_positive():
    with pytest.raises(ValueError, match="repeats"):
        settings(repeats=0)


def test_an_interrupted_sweep_keeps_what_was_measured(events, monkeypatch):
    happened, _ = events
    measured = run.measure_run

    def interrupted_at_the_second_rate(system, target, workload, rate, *args):
        if rate == 1.0:
            raise KeyboardInterrupt
        return measured(system, target, workload, rate, *args)

    monkeypatch.setattr(run, "measure_run", interrupted_at_the_second_rate)
    result = sweep(plans("a", "b"))
    assert result.aborted == "interrupted"
    assert [[r.rate for r in record.runs] for record in result.systems] == [[0.5], [0.5]]
    assert ("stop", "a") in happened and ("stop", "b") in happened


def test_a_system_whose_replay_breaks_later_keeps_its_earlier_runs(events, monkeypatch):
    measured = run.measure_run

    def breaks_at_the_second_rate(system, target, workload, rate, *args):
        if system.plan.system == "a" and rate == 1.0:
            raise ReplayError("connection refused")
        return measured(system, target, workload, rate, *args)

    monkeypatch.setattr(run, "measure_run", breaks_at_the_second_rate)
    result = sweep(plans("a", "b"))
    a, b = result.systems
    assert a.skipped == "stopped running: connection refused" and [r.rate for r in a.runs] == [0.5]
    assert b.skipped is None and [r.rate for r in b.runs] == [0.5, 1.0]
