"""``kvroute bench shapes``: the SLO judgment of simulated requests, the goodput search, the
verdicts, the candidate shapes, and the command end to end on a tiny machine."""

from __future__ import annotations

import json
import time

import pytest

from kvroute.bench.peers.report import Targets
from kvroute.bench.shapes import cli, report
from kvroute.bench.shapes.goodput import Probe, Sweep, attainment, meets_slo, search
from kvroute.bench.shapes.systems import KVROUTE, PEER, REFERENCE, candidate_shapes
from simulator.records import FINISHED, REJECTED, RequestRecord

TARGETS = Targets(ttft_s=1.0, tpot_s=0.15)


def record(status=FINISHED, ttft=0.5, e2e=10.0, tokens=101) -> RequestRecord:
    return RequestRecord("r", 0, 0.0, status, 10, tokens, ttft_seconds=ttft, e2e_seconds=e2e)


@pytest.mark.parametrize("made, met", [
    (record(), True),  # TPOT (10 − 0.5) / 100 = 95 ms
    (record(ttft=1.2), False),
    (record(e2e=20.0), False),  # TPOT 195 ms
    (record(tokens=1, e2e=0.5), True),  # one token: judged on TTFT alone
    (record(status=REJECTED, ttft=None, e2e=None, tokens=0), False),
])
def test_a_request_meets_the_slo_on_both_targets(made, met):
    assert meets_slo(made, TARGETS) is met


def test_attainment_counts_every_request_sent():
    assert attainment([record(), record(ttft=2.0), record(), record(status=REJECTED, ttft=None, e2e=None)],
                      TARGETS) == 0.5
    assert attainment([], TARGETS) == 0.0


@pytest.mark.parametrize("start", [0.5, 1.0, 3.0, 10.0])
def test_the_search_finds_the_largest_rate_that_meets_the_bar(start):
    capacity = 3.7  # a system that serves everything up to 3.7 req/s and nothing past it
    sweep = search(lambda rate: Probe(1.0 if rate <= capacity else 0.0), start, 0.9, refinements=6)
    assert capacity * 0.97 < sweep.goodput <= capacity
    assert all((value == 1.0) == (rate <= capacity) for rate, value in sweep.probes.items())


def test_a_system_that_never_meets_the_bar_has_no_goodput():
    sweep = search(lambda rate: Probe(0.5), 1.0, 0.9)
    assert sweep.goodput is None and len(sweep.probes) == 7  # the start, then six steps down


def outcome(name: str, kind: str, shape: str, goodput: float | None) -> report.Outcome:
    sweep = Sweep(0.9, {goodput: 1.0} if goodput else {1.0: 0.0})
    return report.Outcome(name, kind, shape, sweep)


def test_the_verdicts_name_the_chosen_shape_the_best_peer_and_where_splitting_pays():
    small = report.machine_report(8, [outcome("8u", KVROUTE, "8u", 6.0), outcome("2p6d", KVROUTE, "2p6d", 5.0),
                                      outcome("router-affinity", PEER, "8u", 5.0),
                                      outcome("router-round-robin", REFERENCE, "8u", 6.5)])
    large = report.machine_report(64, [outcome("64u", KVROUTE, "64u", 40.0),
                                       outcome("8p56d", KVROUTE, "8p56d", 50.0),
                                       outcome("router-hash", PEER, "64u", None),
                                       outcome("one-engine", PEER, "1u (x64)", 25.0)])
    assert (small["chosen_shape"], small["best_peer"], small["chosen_over_best_peer"]) == ("8u", "router-affinity", 1.2)
    assert not small["split_pays"] and small["best_aggregated"] == "router-round-robin"
    assert (large["chosen_shape"], large["chosen_over_best_peer"], large["split_pays"]) == ("8p56d", 2.0, True)
    assert report.first_split_win([small, large]) == 64
    assert "first pays at 64 engines" in report.crossover_line([small, large])
    assert "wins" in report.verdict(report.machine_report(8, [outcome("8u", KVROUTE, "8u", 4.0),
                                                              outcome("one-engine", PEER, "1u (x8)", 5.0)]))


@pytest.mark.parametrize("engines, shapes", [
    (1, ["1u"]), (2, ["2u", "1p1d"]), (4, ["4u", "1p3d"]), (8, ["8u", "1p7d", "2p6d", "1p3d4u"]),
    (64, ["64u", "8p56d", "16p48d", "8p24d32u"]),
])
def test_candidate_shapes(engines, shapes):
    assert candidate_shapes(engines) == shapes


def test_the_command_runs_end_to_end_on_a_tiny_machine(tmp_path):
    started = time.process_time()
    code = cli.main(["--engines", "2", "--seconds", "3", "--refinements", "0", "--no-progress",
                     "--output", str(tmp_path)])
    assert code == 0 and time.process_time() - started < 20
    results = json.loads((tmp_path / "results.json").read_text())
    machine = results["machines"][0]
    assert machine["engines"] == 2 and machine["chosen_shape"] in ("2u", "1p1d")
    assert {row["name"] for row in machine["systems"]} == {"2u", "1p1d", "router-hash", "router-affinity",
                                                           "one-engine", "router-round-robin"}
    assert all(row["probes"] for row in machine["systems"]) and results["crossover"]


def test_a_run_stopped_early_fails_its_probe_and_says_so():
    sweep = search(lambda rate: Probe(1.0) if rate < 2 else Probe(0.4, stopped_early=True), 1.0, 0.9, refinements=1)
    assert sweep.goodput is not None and sweep.goodput < 2 and sweep.stopped_early
    assert all(rate >= 2 for rate in sweep.stopped_early)
    rows = report.machine_report(1, [report.Outcome("1u", KVROUTE, "1u", sweep)])["systems"][0]["probes"]
    assert [p["stopped_early"] for p in rows] == [p["rate"] >= 2 for p in rows]
