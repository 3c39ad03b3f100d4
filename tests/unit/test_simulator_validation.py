"""The simulator against a real cluster: CPU cores shared between engines, vLLM's per-step
load reports and held blocks, replayed pull failures, and cost curves fitted to a replay."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.planner.cost_model import PrefillCoefficients, prefill_seconds_with
from orchestrator.planner.policies import POLICIES
from simulator import CpuSettings, EngineConfig, SimCalibration, SimulationSettings, simulate
from simulator.cpu import Cores
from simulator.engine import Engine
from simulator.fleet import ActiveStep, SimWorker
from simulator.from_replay import calibration_from_replay, cluster_from_replay, failed_pulls, fit_link, nonnegative_line
from simulator.records import FINISHED, REJECTED
from simulator.requests import TokenRequest
from tests.unit.sim_requests import SYNTHETIC, engine_request, tokens
from workloads.trace import TraceScaling, load_trace

CALIBRATION = SimCalibration()
ENGINE = EngineConfig(num_blocks=600, block_size=16)


def settings(**changes) -> SimulationSettings:
    return SimulationSettings(prefill_engine=ENGINE, decode_engine=ENGINE, **changes)


def whole_prefill(count: int) -> float:
    return CALIBRATION.step_seconds([(count, 0)], 0)


def ttfts(requests, cpu: CpuSettings, policy: str = "round_robin", **changes) -> list[float]:
    result = simulate(requests, policy, 2, 1, CALIBRATION, settings=settings(cpu=cpu, **changes))
    return [record.ttft_seconds for record in sorted(result.records, key=lambda r: r.index)]


# ---------------------------------------------------------------- the cores


@pytest.mark.parametrize("cpu, busy, expected", [
    (CpuSettings(cores=2), ["e0", "e1", "e2"], {"e0": 0.5, "e1": 1.0, "e2": 0.5}),  # e0, e2 on core 0
    (CpuSettings(cores=2), ["e1"], {"e0": 1.0, "e1": 1.0, "e2": 1.0}),
    (CpuSettings(cores=2, pinned=False), ["e0", "e1", "e2"], {"e0": 2 / 3, "e1": 2 / 3, "e2": 2 / 3}),
    (CpuSettings(cores=2, pinned=False), ["e0", "e1"], {"e0": 1.0, "e1": 1.0, "e2": 1.0}),
    (CpuSettings(cores=2, core_sets=((0, 1), (1,), (0,))), ["e0", "e1"], {"e0": 0.5, "e1": 0.5, "e2": 1.0}),
    (CpuSettings(), ["e0", "e1", "e2"], {"e0": 1.0, "e1": 1.0, "e2": 1.0}),  # default: nothing shared
])
def test_an_engine_computes_at_its_most_shared_cores_pace(cpu, busy, expected):
    cores = Cores(cpu, ["e0", "e1", "e2"])
    for worker_id in busy:
        cores.set_busy(worker_id, True)
    assert {worker_id: cores.speed(worker_id) for worker_id in expected} == pytest.approx(expected)


def test_starting_or_ending_a_step_names_the_engines_whose_pace_changes():
    cores = Cores(CpuSettings(cores=2), ["e0", "e1", "e2"])
    assert cores.set_busy("e0", True) == []
    assert cores.set_busy("e1", True) == []  # core 1: nobody to slow
    assert cores.set_busy("e2", True) == ["e0"]
    assert cores.set_busy("e2", True) == []  # no change, nothing to retime
    assert cores.set_busy("e0", False) == ["e2"]


def test_core_settings_are_checked():
    with pytest.raises(ValueError):
        CpuSettings(cores=2, core_sets=((0,), (2,)))
    with pytest.raises(ValueError):
        CpuSettings(cores=2, pinned=False, core_sets=((0,),))
    with pytest.raises(ValueError, match="names 1 engines"):
        Cores(CpuSettings(cores=1, core_sets=((0,),)), ["e0", "e1"])


# ---------------------------------------------------------------- contention in a simulation


def test_two_prefills_on_one_core_each_take_twice_as_long():
    both = [TokenRequest(0, 0.0, 1, tokens(0, 900)), TokenRequest(1, 0.0, 1, tokens(1, 900))]
    alone = whole_prefill(900)
    assert ttfts(both, CpuSettings()) == pytest.approx([alone, alone])
    assert ttfts(both, CpuSettings(cores=1)) == pytest.approx([2 * alone, 2 * alone])
    # kvroute serve's binding on two cores: the prefill workers get a core each
    assert ttfts(both, CpuSettings(cores=2)) == pytest.approx([alone, alone])


def test_a_step_keeps_its_progress_when_the_sharing_changes_under_it():
    alone = whole_prefill(900)
    staggered = [TokenRequest(0, 0.0, 1, tokens(0, 900)), TokenRequest(1, alone / 2, 1, tokens(1, 900))]
    # the first runs alone for half its work, then at half speed: 1.5x; the second, symmetric
    # (one token each: no decode steps join them on the core)
    assert ttfts(staggered, CpuSettings(cores=1)) == pytest.approx([1.5 * alone, 1.5 * alone])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_shared_cores_conserve_requests_and_blocks_and_only_slow_things_down(trace, policy):
    free = simulate(trace, policy, 2, 2, CALIBRATION, settings=settings())
    shared = simulate(trace, policy, 2, 2, CALIBRATION, settings=settings(cpu=CpuSettings(cores=2)))
    statuses = [r.status for r in shared.records]
    assert len(statuses) == trace.kept  # each ended once; the loop checks nothing is left busy
    if policy != "cache_aware":  # the baselines route whatever the load; cache_aware may answer 429
        assert statuses == [FINISHED] * trace.kept
    assert set(statuses) <= {FINISHED, REJECTED}
    assert all(worker.max_blocks_used <= worker.num_blocks for worker in shared.workers)
    finished = lambda result: [r.e2e_seconds for r in result.records if r.status == FINISHED]  # noqa: E731
    mean_shared, mean_free = (sum(finished(r)) / len(finished(r)) for r in (shared, free))
    assert mean_shared >= mean_free or mean_shared == pytest.approx(mean_free)
    if policy != "local_only":  # its prefill workers stay idle, so no busy engines share a core
        assert mean_shared > mean_free


# ---------------------------------------------------------------- what vLLM reports, what it holds


def test_a_sent_prefill_holds_its_blocks_until_the_engines_next_step_ends():
    engine = Engine(EngineConfig(num_blocks=64, block_size=16, hold_sent_blocks=True))
    engine.submit(engine_request("a", tokens(0, 100), hold_blocks=True))
    engine.complete(engine.schedule(), 0.0, 1.0)  # a's prefill and first token: a ends here
    assert engine.empty and engine.pool.num_used == 7
    engine.submit(engine_request("b", tokens(1, 100), hold_blocks=True))
    step = engine.schedule()
    assert engine.pool.num_used == 14  # a's blocks still held while b computes
    engine.complete(step, 1.0, 1.0)
    assert engine.pool.num_used == 7  # a's freed at the end of that step; b's held now
    assert not engine.schedule().work and engine.pool.num_used == 0  # idle: freed at once


def test_views_show_the_load_as_of_the_last_step_end():
    worker = SimWorker("prefill-0", "prefill", EngineConfig(num_blocks=64, block_size=16), 100,
                       stats_at_step_end=True)
    worker.engine.submit(engine_request("a", tokens(0, 100)))
    step = worker.engine.schedule()
    assert (worker.view(0.0).num_running, worker.view(0.0).num_free_blocks) == (0, 64)  # mid-step: the old report
    worker.report()
    worker.touch()
    assert (worker.view(0.0).num_running, worker.view(0.0).num_free_blocks) == (1, 57)
    assert worker.view(0.0).num_waiting == 0 and step.work


def test_views_list_the_queued_prompts_and_the_step_cap_as_heartbeats_do():
    worker = SimWorker("prefill-0", "prefill", EngineConfig(num_blocks=64, block_size=16, long_prefill_tokens=256), 100)
    worker.engine.submit(engine_request("a", tokens(0, 300)))
    worker.engine.submit(engine_request("b", tokens(1, 200)))
    view = worker.view(0.0)
    assert view.queued_prompts == (300, 200) and view.num_queued_prefill_tokens == 500
    assert view.prompt_step_cap == 256


def test_views_date_the_oldest_prompt_from_the_step_computing_it():
    worker = SimWorker("prefill-0", "prefill", EngineConfig(num_blocks=64, block_size=16, long_prefill_tokens=256), 100)
    request = engine_request("a", tokens(0, 300))
    request.submitted_at = 4.0
    worker.engine.submit(request)
    assert worker.view(5.0).head_prompt_elapsed == 0.0  # no step computes it yet
    worker.active = ActiveStep(worker.engine.schedule(), started_at=4.5, step_seconds=2.0, version=0)
    assert worker.view(5.25).head_prompt_elapsed == pytest.approx(0.75)
    assert worker.view(5.25).queued_prompts == (300,)  # the listing shows no progress inside the step
    dated = worker.view(5.25)
    assert dated == replace(worker.view(5.0), head_prompt_elapsed=dated.head_prompt_elapsed)  # nothing else moved
    assert worker.view(5.0).head_prompt_elapsed == pytest.approx(0.5)  # the cached view is not changed


def test_a_refused_pull_is_prefilled_again_on_the_decode_worker():
    requests = [TokenRequest(0, 0.0, 8, tokens(0, 900))]
    pulled = simulate(requests, "round_robin", 1, 1, CALIBRATION, settings=settings()).records[0]
    refused = simulate(requests, "round_robin", 1, 1, CALIBRATION,
                       settings=settings(failed_pulls=frozenset({0}))).records[0]
    assert refused.status == FINISHED and refused.output_tokens == 8
    assert refused.ttft_seconds == pytest.approx(pulled.ttft_seconds)  # the first token came from prefill
    assert refused.transfer_bytes == 0 and pulled.transfer_bytes > 0
    assert refused.second_token_gap_seconds > pulled.second_token_gap_seconds + whole_prefill(800)


# ---------------------------------------------------------------- fitting a replay

TRUE_PREFILL = PrefillCoefficients(fixed_seconds=0.12, per_token_seconds=3e-3, attention_seconds=2.5e-6)
TRUE_STEP = (0.07, 0.012)  # decode step: fixed, per sequence
WORKERS = {"prefill-a": "prefill@0", "prefill-b": "prefill@1", "decode-a": "decode@0"}


def step_seconds(batch: int) -> float:
    return TRUE_STEP[0] + TRUE_STEP[1] * batch


def row(index: int, sent: float, new: int, cached: int, token_times: list[float]) -> dict:
    """A DISAGG request prefilled on prefill-b (a core of its own), decoded on decode-a."""
    return {"policy": "p", "index": index, "status": 200, "error": None, "counted": True, "sent_s": sent,
            "prompt_tokens": new + cached, "cached_tokens": cached, "plan_kind": "disagg",
            "prefill_worker": "prefill-b", "decode_worker": "decode-a", "prefilling_worker": "prefill-b",
            "ttft_s": token_times[0] - sent, "e2e_s": token_times[-1] - sent,
            "chunk_times_s": [t - sent for t in token_times], "response_id": f"resp-{index}"}


def overlapping_pair(index: int, start: float, first: tuple[int, int], second: tuple[int, int]) -> list[dict]:
    """Two requests whose decodes overlap: the second's first token lands on one of the
    first's decode steps, after which both decode in the same steps."""
    a_first = start + prefill_seconds_with(TRUE_PREFILL, *first)
    b_prefill = prefill_seconds_with(TRUE_PREFILL, *second)
    a_times = [a_first]
    while a_times[-1] < a_first + b_prefill:  # alone until b's prefill (started at a's first token) is done
        a_times.append(a_times[-1] + step_seconds(1))
    b_sent = a_times[-1] - b_prefill
    b_times = [a_times[-1]]
    for _ in range(8):  # decoding together
        a_times.append(a_times[-1] + step_seconds(2))
        b_times.append(a_times[-1])
    for _ in range(8):  # b alone after a ended
        b_times.append(b_times[-1] + step_seconds(1))
    return [row(index, start, *first, a_times), row(index + 1, b_sent, *second, b_times)]


@pytest.fixture(scope="module")
def replay() -> dict:
    shapes = [((1200, 0), (100, 1152)), ((900, 0), (60, 768)), ((1400, 0), (300, 1024)), ((700, 128), (1000, 0)),
              ((1100, 256), (200, 640)), ((500, 0), (1300, 0))]
    rows = []
    for k, (first, second) in enumerate(shapes):
        rows += overlapping_pair(2 * k, 1000.0 * k, first, second)
    return {"workers": WORKERS, "machine": {"cpus": 2}, "settings": {"kv_cache_gib_used": 0.3},
            "workload": {"kv_cache_tokens_per_worker": 6983.5}, "summaries": {"p": {}}, "requests": rows}


def test_the_fit_recovers_the_curves_the_rows_were_made_with(replay):
    calibration = calibration_from_replay(replay)
    assert calibration.prefill_fixed_seconds == pytest.approx(TRUE_PREFILL.fixed_seconds, rel=1e-6)
    assert calibration.prefill_per_token_seconds == pytest.approx(TRUE_PREFILL.per_token_seconds, rel=1e-6)
    assert calibration.prefill_attention_seconds == pytest.approx(TRUE_PREFILL.attention_seconds, rel=1e-6)
    assert calibration.decode_step_fixed_seconds == pytest.approx(TRUE_STEP[0], rel=1e-6)
    assert calibration.decode_per_sequence_seconds == pytest.approx(TRUE_STEP[1], rel=1e-6)
    assert calibration.step_jitter == pytest.approx(0.0, abs=1e-9)
    assert calibration.bytes_per_token == round(0.3 * 2**30 / 6983.5)


def test_a_prefill_slowed_by_a_core_mate_is_left_out_of_the_fit(replay):
    slowed = dict(replay["requests"][0], prefill_worker="prefill-a", prefilling_worker="prefill-a",
                  ttft_s=replay["requests"][0]["ttft_s"] * 3)
    mate_ttft = prefill_seconds_with(TRUE_PREFILL, 100, 1152)
    busy_mate = dict(replay["requests"][1], sent_s=slowed["sent_s"] - 50.0, ttft_s=mate_ttft, e2e_s=200.0,
                     chunk_times_s=[mate_ttft, 200.0], index=99)  # decodes on core 0 through the slow prefill
    calibration = calibration_from_replay({**replay, "requests": [slowed, busy_mate] + replay["requests"][2:]})
    assert calibration.prefill_per_token_seconds == pytest.approx(TRUE_PREFILL.per_token_seconds, rel=1e-6)


def test_too_few_samples_keep_the_defaults():
    calibration = calibration_from_replay({"workers": WORKERS, "requests": [], "summaries": {}})
    assert calibration == SimCalibration()


def test_the_link_fit_recovers_latency_and_bandwidth():
    pulls = [(size, 0.2 + size / 2e9) for size in (5e6, 30e6, 70e6, 12e6)]
    latency, bandwidth = fit_link(pulls)
    assert latency == pytest.approx(0.2) and bandwidth == pytest.approx(2e9)
    assert fit_link(pulls[:1]) is None


@pytest.mark.parametrize("x, y, expected", [
    ([1, 2, 3], [3, 5, 7], (1.0, 2.0)),
    ([1, 2, 3], [7, 5, 3], (5.0, 0.0)),  # a falling line: no slope, the mean
    ([1, 2, 3], [1, 3, 5], (0.0, 22 / 14)),  # a negative intercept: through the origin
])
def test_lines_are_fitted_without_negative_coefficients(x, y, expected):
    import numpy as np
    assert nonnegative_line(np.array(x, float), np.array(y, float)) == pytest.approx(expected)


def test_the_cluster_and_its_core_binding_come_from_the_labels(replay):
    decisions = [{"block_size": 128, "request_id": "abc", "response_id": "resp-3"}]
    cluster = cluster_from_replay(replay, decisions)
    assert (cluster.num_prefill, cluster.num_decode) == (2, 1)
    assert cluster.worker_ids == ("prefill-a", "prefill-b", "decode-a")
    assert cluster.cpu == CpuSettings(cores=2, core_sets=((0,), (1,), (0,)))
    assert (cluster.engine.num_blocks, cluster.engine.block_size) == (54, 128)  # 6,912 tokens, as vLLM rounds
    settings = cluster.settings()
    assert settings.stats_at_step_end and settings.prefill_engine.hold_sent_blocks
    # a replay that did not record its workers' step caps ran with the caps of that time
    assert (settings.prefill_engine.long_prefill_tokens, settings.decode_engine.long_prefill_tokens) == (0, 256)
    recorded = {**replay, "workload": {**replay["workload"], "long_prefill_tokens": {"prefill": 128, "decode": 64}}}
    settings = cluster_from_replay(recorded, decisions).settings()
    assert (settings.prefill_engine.long_prefill_tokens, settings.decode_engine.long_prefill_tokens) == (128, 64)
    log = "pull for request abc-0123abcd failed (producer refused the pull: unknown or expired handle); recomputing"
    assert failed_pulls(replay, decisions, [log]) == {"p": frozenset({3})}


@pytest.fixture(scope="module")
def trace():
    if not SYNTHETIC.exists():
        pytest.skip("shared/data not present")
    return load_trace(SYNTHETIC, TraceScaling(block_tokens=32, time_scale=0.01), limit=80)
