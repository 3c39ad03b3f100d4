"""Fitting the simulator to a topology's long-output runs (simulator.shape_fit) and reading those
runs (kvroute.bench.simulation.fit_shapes): the fit recovers the curves rows were made with by
a one-engine step model, and the runs' cluster is the one kvroute serve starts."""

from __future__ import annotations

import json
import random

import pytest

from kvroute.bench.simulation.fit_shapes import ShapeRuns, cluster, compare, per_core_curves, read_runs
from orchestrator.planner.cost_model import PrefillCoefficients, prefill_seconds_with
from simulator import SimCalibration
from simulator.shape_fit import PromptCost, fit_prefill_curve, fit_shape, lone_prefills, prompt_seconds
from worker.settings import default_long_prefill_tokens

TRUE_STEP = (0.02, 0.003)  # a decode step: fixed + per sequence
SCALE = 1.5  # the prompts cost this many times the start-up curve
DEFAULT = SimCalibration()
CURVE = PrefillCoefficients(DEFAULT.prefill_fixed_seconds, DEFAULT.prefill_per_token_seconds,
                            DEFAULT.prefill_attention_seconds)
WORKER = "unified-a"


def one_engine_rows(arrivals: list[float], prompts: list[tuple[int, int]], tokens: int = 120) -> list[dict]:
    """Rows of one engine that steps back to back: a step computes the oldest waiting prompt
    (``SCALE`` x the start-up curve) and one token of every running request (per sequence);
    a step without a prompt costs the fixed part too. A prompt arriving mid-step waits for it."""
    now, waiting, running, times = 0.0, list(range(len(arrivals))), [], {i: [] for i in range(len(arrivals))}
    while waiting or running:
        if not running and arrivals[waiting[0]] > now:
            now = arrivals[waiting[0]]  # idle until the next arrival
        ready = [i for i in waiting if arrivals[i] <= now]
        step = TRUE_STEP[1] * len(running)
        if ready:
            step += SCALE * prefill_seconds_with(CURVE, *prompts[ready[0]])
        else:
            step += TRUE_STEP[0]
        now += step
        for i in running:
            times[i].append(now)
        running = [i for i in running if len(times[i]) < tokens]
        if ready:
            waiting.remove(ready[0])
            times[ready[0]].append(now)
            running.append(ready[0])
    return [{"index": i, "sent_s": arrivals[i], "prompt_tokens": sum(prompts[i]), "cached_tokens": prompts[i][1],
             "ttft_s": times[i][0] - arrivals[i], "e2e_s": times[i][-1] - arrivals[i],
             "chunk_times_s": [t - arrivals[i] for t in times[i]], "plan_kind": "local",
             "prefilling_worker": WORKER, "decode_worker": WORKER} for i in range(len(arrivals))]


@pytest.fixture(scope="module")
def runs() -> list[list[dict]]:
    rng = random.Random(7)
    made = []
    for rate in (0.5, 2.0):
        arrivals = sorted(rng.uniform(0, 40 / rate) for _ in range(40))
        prompts = [(rng.choice((90, 600)), rng.choice((0, 512))) for _ in arrivals]
        made.append(one_engine_rows(arrivals, prompts))
    return made


def test_the_fit_recovers_the_decode_step_and_the_prompts_scale(runs):
    fit = fit_shape(runs, {WORKER: (0, 1)})
    assert fit.calibration.decode_step_fixed_seconds == pytest.approx(TRUE_STEP[0], rel=1e-6)
    assert fit.calibration.decode_per_sequence_seconds == pytest.approx(TRUE_STEP[1], rel=1e-6)
    # The wait for the step under way is taken as half a step: right on average, not per prompt.
    for prompt in ((600, 0), (90, 512)):
        assert prefill_seconds_with(fit.prefill, *prompt) == pytest.approx(
            SCALE * prefill_seconds_with(CURVE, *prompt), rel=0.1)
    assert fit.calibration.prefill_per_token_seconds == fit.prefill.per_token_seconds
    assert fit.prompt_costs >= 20 and fit.decode_gaps > 1000
    decoding = [cost for rows in runs for cost in lone_prefills(rows, {WORKER: (0, 1)}) if cost.decodes]
    assert len(decoding) >= 10, "the scale must come from prompts that joined running decodes too"


def test_a_prompt_overlapped_by_another_prompt_says_nothing_about_its_cost(runs):
    rows, cores = runs[0], {WORKER: (0, 1)}
    before = lone_prefills(rows, cores)
    lone = {(cost.new_tokens, cost.cached_tokens, cost.ttft_s) for cost in before}
    target = next(row for row in rows if (row["prompt_tokens"] - row["cached_tokens"], row["cached_tokens"],
                                          row["ttft_s"]) in lone)
    blocker = dict(target, index=99, sent_s=target["sent_s"] - 0.001, ttft_s=target["ttft_s"] + 0.01)
    # Both leave: the target was overlapped by the blocker's prompt, the blocker by the target's.
    assert len(lone_prefills(rows + [blocker], cores)) == len(before) - 1


def test_too_few_prompts_keep_the_start_up_curve():
    fit = fit_shape([[]], {WORKER: (0,)})
    assert fit.prefill is None and fit.calibration == DEFAULT


def test_prompts_all_alike_scale_the_whole_curve():
    costs = [PromptCost(100, 512, 0, 2 * prefill_seconds_with(CURVE, 100, 512)) for _ in range(10)]
    curve, spread = fit_prefill_curve(costs, DEFAULT)
    assert curve.fixed_seconds == pytest.approx(2 * CURVE.fixed_seconds)
    assert curve.attention_seconds == pytest.approx(2 * CURVE.attention_seconds) and spread == pytest.approx(0)


def test_a_prompt_pays_its_decodes_share_and_half_a_step_of_waiting():
    cost = PromptCost(new_tokens=100, cached_tokens=0, decodes=4, ttft_s=0.5)
    step = DEFAULT.decode_step_fixed_seconds + 4 * DEFAULT.decode_per_sequence_seconds
    assert prompt_seconds(cost, DEFAULT) == pytest.approx(0.5 - 4 * DEFAULT.decode_per_sequence_seconds - step / 2)
    assert prompt_seconds(PromptCost(100, 0, 0, 0.5), DEFAULT) == 0.5


def peers_results(topology: str, workers: list[str]) -> dict:
    rows = [{"system": "kvroute", "workload": "long-output", "rate": 0.5, "index": i, "error": None, "ttft_s": 0.1,
             "prefilling_worker": worker, "decode_worker": workers[-1]} for i, worker in enumerate(workers)]
    source = {"requests": 2, "generator": "prefix-repetition", "rate": 0.5, "seed": 0, "options": []}
    return {"systems": [{"system": "kvroute", "skipped": None, "settings": {"topology": topology, "extra_args": []}}],
            "resources": {"dtype": "bfloat16", "total_kv_gib": 0.75, "cores": "0-1"},
            "settings": {"seed": 0}, "sources": {"long-output@0.5": source}, "requests": rows}


def test_the_cluster_is_the_one_kvroute_serve_starts(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(peers_results("1p1d", ["prefill-x1", "decode-y2"])))
    shape = read_runs([path])["1p1d"]
    counts, settings, cores = cluster(shape)
    assert counts == {"prefill": 1, "decode": 1, "unified": 0}
    assert cores == {"prefill-x1": (0,), "decode-y2": (1,)}
    assert settings.cpu.core_sets == ((0,), (1,))
    # Half of 0.75 GiB each, bfloat16 SmolLM2 (23,040 bytes a token), blocks of 32 tokens.
    assert settings.decode_engine.num_blocks == int(0.375 * 2**30 / 23040 // 32)
    assert settings.prefill_engine.long_prefill_tokens == default_long_prefill_tokens("prefill")
    assert settings.decode_engine.long_prefill_tokens == default_long_prefill_tokens("decode")
    assert settings.tpot_target_seconds == pytest.approx(0.15)
    assert settings.planner.max_in_flight == 32, "a run that recorded no planner defaults ran the old cap"


def test_the_planner_settings_are_the_runs_own(tmp_path):
    results = peers_results("1u", ["unified-a"])
    results["systems"][0]["settings"] |= {"planner_defaults": {"max_in_flight_per_worker": 256,
                                                               "tpot_target_seconds": 0.15},
                                          "extra_args": ["--tpot-target-seconds", "0.3"]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    shape = read_runs([path])["1u"]
    assert (shape.max_in_flight, shape.tpot_target_s) == (256, 0.3)


def test_auto_resolves_to_the_topology_serve_picked(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(peers_results("auto", ["unified-a"])))
    assert list(read_runs([path])) == ["1u"]


def test_a_file_without_kvroute_long_output_rows_is_refused(tmp_path):
    results = peers_results("1u", ["unified-a"])
    results["requests"] = []
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    with pytest.raises(SystemExit, match="no long-output rows of kvroute"):
        read_runs([path])


def test_each_metric_is_judged_by_its_ratio():
    real = {"ttft_p50_s": 0.1, "ttft_p99_s": 0.4, "tpot_p50_s": 0.02, "tpot_p99_s": 0.03}
    simulated = {"ttft_p50_s": 0.12, "ttft_p99_s": 0.2, "tpot_p50_s": 0.02, "tpot_p99_s": 0.038}
    judged = compare(real, simulated, 0.25)
    assert judged["within_band"] == {"ttft_p50_s": True, "ttft_p99_s": False, "tpot_p50_s": True,
                                     "tpot_p99_s": False}
    assert judged["ratios"]["ttft_p99_s"] == pytest.approx(0.5)


def test_one_engine_on_one_core_takes_the_unified_steps_and_the_link_that_moved_kv():
    def report(step: float, pulls: int, latency: float) -> dict:
        return {"fit": {"pulls": pulls, "calibration": {"decode_step_fixed_seconds": step,
                                                        "link_latency_seconds": latency,
                                                        "link_bandwidth_bytes_per_second": 1e9}}}

    shapes = {topology: ShapeRuns(topology, "bfloat16", 0.75, (0, 1), 0, 0.15, 256, {}, {})
              for topology in ("1u", "2u", "1p1d")}
    reports = {"1u": report(0.01, 0, 0.001), "2u": report(0.02, 0, 0.001), "1p1d": report(0.03, 40, 0.004)}
    curves = per_core_curves(shapes, reports)
    assert curves["decode_step_fixed_seconds"] == 0.02 and curves["link_latency_seconds"] == 0.004
    assert per_core_curves({"1u": shapes["1u"]}, {"1u": reports["1u"]}) is None
