"""``kvroute bench disagg --paths``: each transfer path gets a worker pair started with its own
flags, requests alternate between the paths in a turning order, each path's warm-up stays out
of its medians, and the report gives TTFT, hand-off gap and their sum per path with the ratio
to the first path. A short run of the phase over stand-in requests, no engines."""

from __future__ import annotations

import argparse
import asyncio
import itertools

import pytest

from foundation import wire
from kvroute.bench.disagg import cli, paths, report


def arguments(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(extra))


def test_each_path_starts_its_pair_with_its_own_flags_and_only_the_first_hosts_the_measured_links():
    args = arguments("--paths", "default", "nixl", "auto", "--links", "zmq-ipc")
    default, nixl, auto = (cli.worker_args(args, "m", "0", path) for path in args.paths)
    assert default[-2:] == ["--transfer-link-hosts", "zmq-ipc"]
    assert nixl[-2:] == ["--transfer-link", "nixl"] and "--transfer-link-hosts" not in nixl
    assert auto[-2:] == ["--transfer-link", "auto"]
    assert default[:-2] == nixl[:-2] == auto[:-2]  # alike in everything else


@pytest.mark.parametrize("extra, complaint", [
    (("--phases", "end_to_end"), "add --phases transfer"),
    (("--phases", "paths"), "two or more --paths"),
    (("--ttft-lengths", "9000"), "do not fit max_model_len"),
])
def test_impossible_runs_are_refused_before_any_engine_starts(extra, complaint):
    with pytest.raises(SystemExit, match=complaint):
        cli.check_phases(arguments(*extra))


def test_the_order_of_the_paths_turns_each_repetition():
    assert [paths.request_order(["a", "b", "c"], rep) for rep in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def run(ttft: float, gap: float | None, pulled: bool = True) -> dict:
    return {"ttft_s": ttft, "handoff_gap_s": gap, "decode_pull_seconds": 0.01,
            "decode_pulls_ok": int(pulled), "decode_pulls_failed": int(not pulled)}


def test_compare_sums_each_requests_ttft_and_gap_and_divides_by_the_baseline():
    compared = paths.compare({"default": [run(0.2, 0.1), run(0.4, 0.2)],
                              "nixl": [run(0.2, 0.05), run(0.4, None, pulled=False)]})
    assert compared["default"]["ttft_plus_gap_s"]["median"] == pytest.approx(0.45)
    assert compared["default"]["ratio_vs_baseline"]["ttft_plus_gap_s"] == 1.0
    assert compared["nixl"]["ttft_plus_gap_s"]["samples"] == [pytest.approx(0.25), None]
    assert compared["nixl"]["ratio_vs_baseline"]["ttft_plus_gap_s"] == pytest.approx(0.25 / 0.45)
    assert compared["nixl"]["ratio_vs_baseline"]["handoff_gap_s"] == pytest.approx(0.05 / 0.15)
    assert compared["default"]["all_pulled"] and not compared["nixl"]["all_pulled"]


class StandInDecode:
    async def stats(self, timeout):
        measured = wire.LinkMeasurement(chosen="nixl", candidates=["zmq-ipc", "nixl"], seconds=[0.01, 0.002])
        counters = wire.TransferCounters(direct_pulls=3, links_measured=1, link_measurements=[measured])
        return argparse.Namespace(transfer=counters)  # the one part of WorkerStats the phase reads


class StandInContext:
    def __init__(self, path: str, args, prompts):
        self.path, self.args, self.prompts, self.decode = path, args, prompts, StandInDecode()


class StandInPrompts:
    def chat(self, approx_tokens: int) -> list[int]:
        return [0] * approx_tokens


def test_a_short_run_alternates_the_paths_and_keeps_warm_ups_apart(monkeypatch):
    args = arguments("--paths", "default", "nixl", "--ttft-lengths", "64", "128", "--ttft-reps", "2")
    visits: list[tuple[str, int]] = []
    clock = itertools.count(1)

    async def request(ctx, prompt):
        visits.append((ctx.path, len(prompt)))
        tick = next(clock)  # the warm-ups are the slowest: they must not reach the medians
        return run(ttft=1.0 / tick, gap=(0.5 if ctx.path == "default" else 0.25) / tick)

    monkeypatch.setattr(paths, "disaggregated_request", request)
    contexts = {path: StandInContext(path, args, StandInPrompts()) for path in args.paths}
    results = asyncio.run(paths.measure_paths(contexts))
    assert visits == [("default", 64), ("nixl", 64),  # warm-ups, at the shortest length
                      ("default", 64), ("nixl", 64), ("nixl", 64), ("default", 64),
                      ("default", 128), ("nixl", 128), ("nixl", 128), ("default", 128)]
    assert results["warm_up"]["default"]["ttft_s"] == 1.0
    assert results["lengths"]["64"]["default"]["ttft_s"]["samples"] == [1 / 3, 1 / 6]
    assert results["decode_counters"]["nixl"]["direct_pulls"] == 3
    assert results["decode_counters"]["nixl"]["link_measurements"][0]["chosen"] == "nixl"
    report.console.begin_capture()
    report.print_tables({"paths": results})
    printed = report.console.end_capture()
    assert "Paths side by side" in printed and "TTFT + gap / default" in printed and "direct_pulls 3" in printed


@pytest.mark.parametrize("extra, complaint", [
    (("--pair-starts", "0"), "at least 1"),
    (("--pair-starts", "2"), "give two or more --paths"),
    (("--pair-starts", "2", "--paths", "default", "nixl", "--phases", "ttft"), "give two or more --paths"),
])
def test_pair_starts_repeat_only_a_paths_phase(extra, complaint):
    with pytest.raises(SystemExit, match=complaint):
        cli.check_phases(arguments(*extra))
    cli.check_phases(arguments("--pair-starts", "3", "--paths", "default", "nixl", "--phases", "paths"))


def test_the_starts_of_the_pairs_are_compared_together_and_each_kept():
    def start(default_ttft: float, nixl_ttft: float) -> dict:
        lengths = {"1024": paths.compare({"default": [run(default_ttft, 0.04)], "nixl": [run(nixl_ttft, 0.03)]})}
        counters = {"default": {"pulls_ok": 1, "link_measurements": []},
                    "nixl": {"pulls_ok": 1, "link_measurements": ["m"]}}
        return {"baseline": "default", "warm_up": {"default": {}, "nixl": {}}, "lengths": lengths,
                "decode_counters": counters}

    # A slow nixl pair in the first start, a slow default pair in the second: pooled, they cancel.
    pooled = paths.pool_starts([start(0.75, 0.88), start(0.88, 0.75)])
    entry = pooled["lengths"]["1024"]["nixl"]
    assert len(entry["runs"]) == 2 and pooled["starts"] == 2 and len(pooled["warm_up"]) == 2
    # Medians of TTFT + gap over both starts: nixl (0.91, 0.78) against default (0.79, 0.92).
    assert entry["ratio_vs_baseline"]["ttft_plus_gap_s"] == pytest.approx(0.845 / 0.855)
    assert pooled["decode_counters"]["nixl"] == {"pulls_ok": 2, "link_measurements": ["m", "m"]}
    by_start = pooled["ttft_plus_gap_ratio_by_start"]
    assert by_start[0]["1024"]["nixl"] == pytest.approx(0.91 / 0.79) and by_start[1]["1024"]["nixl"] == pytest.approx(
        0.78 / 0.92)
    single = start(0.75, 0.88)
    assert paths.pool_starts([single]) is single
    report.console.begin_capture()
    report.print_tables({"paths": pooled})
    printed = report.console.end_capture()
    assert "~1024 tokens, TTFT + gap / default start by start: nixl 1.15x; nixl 0.85x" in printed
