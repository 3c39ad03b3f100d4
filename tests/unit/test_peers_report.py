"""``kvroute bench peers``' judgement: SLO per request, goodput, winners, ratios, verdict wording,
the terminal tables and results.json's shape, skipped systems included. Pure: made-up rows."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from kvroute.bench.peers import report, results, table
from kvroute.bench.peers.run import RunRecord, Sweep, SystemRecord
from kvroute.bench.replay import Row

TARGETS = report.Targets(ttft_s=1.0, tpot_s=0.1)


def row(index: int, ttft: float | None = 0.2, itl: float | None = 0.05, error: str | None = None,
        status: int = 200, prompt: int = 100, cached: int = 50, completion: int = 16) -> Row:
    return Row("s", index, None, scheduled_s=index * 0.1, sent_s=index * 0.1, status=status, error=error,
               ttft_s=ttft, itl_s=itl, e2e_s=None if ttft is None else ttft + 1, prompt_tokens=prompt,
               cached_tokens=cached, completion_tokens=completion)


@pytest.mark.parametrize(("ttft", "itl", "error", "met"), [
    (0.5, 0.05, None, True),
    (1.0, 0.1, None, True),  # on the target is within it
    (1.2, 0.05, None, False),
    (0.5, 0.2, None, False),
    (0.5, None, None, True),  # a one-token answer has no TPOT: judged on TTFT alone
    (None, None, "boom", False),
])
def test_a_request_meets_the_slo_only_within_both_targets(ttft, itl, error, met):
    assert report.meets_slo(row(0, ttft, itl, error), TARGETS) is met


def test_run_metrics_count_failures_against_attainment():
    rows = [row(k) for k in range(8)] + [row(8, ttft=3.0), row(9, None, None, "ConnectError", status=0)]
    metrics = report.run_metrics(rows, 10.0, TARGETS, lengths={k: 16 for k in range(10)} | {0: 32})
    assert (metrics["requests"], metrics["succeeded"], metrics["errors"], metrics["lost"]) == (10, 9, 1, 1)
    assert metrics["slo_met"] == 8 and metrics["slo_attainment"] == 0.8
    assert metrics["meets_goodput_bar"] is False  # 80% < 90%
    assert metrics["hit_rate"] == 0.5 and metrics["ttft_p50_s"] == pytest.approx(0.2)
    assert metrics["tpot_p50_s"] == pytest.approx(0.05)
    assert metrics["outputs_not_of_requested_length"] == 1  # request 0 asked for 32 tokens, got 16


@pytest.mark.parametrize(("bars", "expected"), [
    ({0.5: True, 1.0: True, 2.0: False}, 1.0),
    ({0.5: True, 1.0: False, 2.0: True}, 2.0),  # the largest passing rate, even past a failing one
    ({0.5: False, 1.0: False}, None),
    ({}, None),
])
def test_goodput_is_the_largest_rate_that_met_the_bar(bars, expected):
    assert report.goodput({rate: {"meets_goodput_bar": ok} for rate, ok in bars.items()}) == expected


def test_winners_share_ties_and_skip_missing_values():
    assert report.winners({"a": 0.2, "b": 0.1, "c": None}, lower_is_better=True) == ["b"]
    assert report.winners({"a": 0.9, "b": 0.9}, lower_is_better=False) == ["a", "b"]
    assert report.winners({"a": None}, lower_is_better=True) == []


def test_a_peer_that_wins_is_named_the_winner():
    comparison = report.compare({"kvroute": 0.132, "vllm": 0.088, "router-cache_aware": 0.165},
                                report.RUN_METRICS[0])
    assert comparison["winners"] == ["vllm"] and comparison["best_peer"] == "vllm"
    assert comparison["kvroute_over_best_peer"] == pytest.approx(1.5)
    assert comparison["verdict"] == "TTFT P50: vllm wins (88 ms); kvroute 132 ms, 1.50x vllm"


def test_kvroute_winning_is_compared_with_the_best_peer():
    hit = next(m for m in report.RUN_METRICS if m.key == "hit_rate")
    comparison = report.compare({"kvroute": 0.8, "vllm": 0.4, "router-cache_aware": 0.6}, hit)
    assert comparison["winners"] == ["kvroute"] and comparison["best_peer"] == "router-cache_aware"
    assert comparison["verdict"] == "hit rate: kvroute wins (80.0%); 1.33x the best peer, router-cache_aware (60.0%)"


def test_kvroute_with_its_tier_is_compared_with_kvroute_and_is_no_peer():
    comparison = report.compare({"kvroute": 0.6, "kvroute-tier": 0.3, "vllm": 0.5}, report.RUN_METRICS[0])
    assert comparison["winners"] == ["kvroute-tier"] and comparison["best_peer"] == "vllm"
    assert comparison["tier_over_kvroute"] == pytest.approx(0.5)
    assert comparison["kvroute_over_best_peer"] == pytest.approx(1.2)


def test_goodput_verdicts_without_a_passing_rate():
    comparison = report.compare({"kvroute": None, "vllm": 0.5}, report.GOODPUT)
    assert comparison["verdict"] == "goodput: vllm wins (0.5 req/s); kvroute -"
    assert report.compare({"kvroute": None, "vllm": None}, report.GOODPUT)["verdict"] == \
        "goodput: no system met the bar at any swept rate"


def test_kv_aware_credits_read_through_the_routers_colours():
    log = ("\x1b[2mKV prefix decision\x1b[0m credited_prefix_tokens=0 x\n"
           "KV prefix decision \x1b[3mcredited_prefix_tokens\x1b[0m\x1b[2m=\x1b[0m288 y\n")
    assert report.kv_aware_credits(log) == {"decisions": 2, "credited_decisions": 1, "credited_tokens": 288}


def sweep_with_a_skip() -> Sweep:
    def run(system: str, rate: float, ttft: float) -> RunRecord:
        rows = [row(k, ttft=ttft) for k in range(10)]
        return RunRecord(system, "repository-assistant", rate, rows, report.run_metrics(rows, 5.0, TARGETS),
                         {"reset": True})

    return Sweep(systems=[
        SystemRecord("kvroute", "kvroute serve", {"topology": "2p1d"}, runs=[run("kvroute", 0.5, 0.3),
                                                                              run("kvroute", 1.0, 2.0)]),
        SystemRecord("vllm", "one vLLM server", runs=[run("vllm", 0.5, 0.2), run("vllm", 1.0, 0.4)]),
        SystemRecord("router-pd", skipped="no P/D connector here"),
    ], sources={"repository-assistant@0.5": {"requests": 10}})


def test_results_json_has_runs_goodput_comparisons_and_skips():
    sweep = sweep_with_a_skip()
    comparisons = report.comparisons(sweep.metrics())
    doc = json.loads(json.dumps(results.document(sweep, {"rates": [0.5, 1.0]}, {"dtype": "float32"}, TARGETS,
                                                 comparisons), default=str))
    assert [s["system"] for s in doc["systems"]] == ["kvroute", "vllm", "router-pd"]
    assert doc["systems"][2]["skipped"] == "no P/D connector here"
    assert {(r["system"], r["rate"]) for r in doc["runs"]} == {("kvroute", 0.5), ("kvroute", 1.0), ("vllm", 0.5),
                                                              ("vllm", 1.0)}
    assert all({"ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p50_s", "hit_rate", "errors", "lost",
                "meets_goodput_bar"} <= set(r) for r in doc["runs"])
    assert doc["goodput"] == {"repository-assistant": {"kvroute": 0.5, "vllm": 1.0}}
    goodput = doc["comparisons"]["repository-assistant"]["goodput"]
    assert goodput["winners"] == ["vllm"] and goodput["kvroute_over_best_peer"] == 0.5
    assert doc["comparisons"]["repository-assistant"]["rates"]["0.5"]["ttft_p50_s"]["winners"] == ["vllm"]
    assert len(doc["requests"]) == 40 and doc["router"]["version"] == "0.1.17"


def test_the_table_names_winners_and_skipped_systems():
    sweep = sweep_with_a_skip()
    console = Console(record=True, width=200)
    table.print_report(console, sweep, report.comparisons(sweep.metrics()), TARGETS)
    text = console.export_text()
    assert "@0.5/s  TTFT P50: vllm wins (200 ms); kvroute 300 ms, 1.50x vllm" in text
    assert "goodput: vllm wins (1 req/s); kvroute 0.5 req/s, 0.50x vllm" in text
    assert "router-pd skipped: no P/D connector here" in text
    assert "router-pd" in text.split("Goodput")[0]  # a row of the workload's table too


def test_round_by_round_ratios_show_a_run_the_machine_slowed_that_pooled_percentiles_hide():
    def metrics(ttft: float) -> dict:
        return {"ttft_p50_s": ttft, "hit_rate": 0.5}

    # Round 2 was slow for kvroute alone; round 3 for vllm alone.
    rounds = {"kvroute": (metrics(1.0), metrics(1.8), metrics(1.0)),
              "vllm": (metrics(1.0), metrics(1.0), metrics(1.9)),
              "router-cache_aware": (metrics(1.2), metrics(1.5), metrics(1.5))}
    pooled = {system: {"repository-assistant": {0.5: metrics(1.2)}} for system in rounds}
    by_round = {system: {"repository-assistant": {0.5: runs}} for system, runs in rounds.items()}
    ttft = report.comparisons(pooled, by_round)["repository-assistant"]["rates"][0.5]["ttft_p50_s"]
    assert ttft["kvroute_over_best_peer_by_round"] == pytest.approx([1.0, 1.8, 1.0 / 1.5])
    assert ttft["median_by_round"] == pytest.approx(1.0)
    assert ttft["verdict"].endswith("; by round 1.00x 1.80x 0.67x (median 1.00x)")
    one_round = {system: {"repository-assistant": {0.5: runs[:1]}} for system, runs in rounds.items()}
    alone = report.comparisons(pooled, one_round)["repository-assistant"]["rates"][0.5]["ttft_p50_s"]
    assert "by round" not in alone["verdict"] and "median_by_round" not in alone
