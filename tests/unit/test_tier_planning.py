"""The planner prices a node-store load (orchestrator.planner.plans): the blocks a worker's
store holds past its engine's are loaded at the tier's estimated speed instead of computed,
so a worker whose store holds a prompt beats a cold one, and loses to one whose engine
holds it; the estimate and the decision record name the tier's share."""

from __future__ import annotations

from dataclasses import replace

from orchestrator.decisions import DecisionRecord
from orchestrator.planner import cost_model as cost
from orchestrator.planner.calibration import Calibration
from orchestrator.planner.candidates import prune
from orchestrator.planner.cost_model import CostModel, LinkEstimate
from orchestrator.planner.planner import CacheAwarePlanner
from orchestrator.planner.plans import local_plan, prefill_reuse, pull_plan
from orchestrator.planner.settings import PlannerSettings
from orchestrator.planner.views import PlanKind, RequestView, WorkerView

BLOCK = 16
REQUEST = RequestView("r1", prompt_tokens=900, expected_output_tokens=16, block_size=BLOCK)  # 56 full blocks + 4
BYTES = BLOCK * 23_040
MODEL = CostModel()


def worker(worker_id: str, role: str = "unified", **fields) -> WorkerView:
    defaults = dict(num_running=0, num_waiting=0, num_queued_prefill_tokens=0, num_free_blocks=1000,
                    num_total_blocks=1000, block_size=BLOCK, bytes_per_block=BYTES)
    return WorkerView(worker_id, role, **{**defaults, **fields})


def test_the_store_run_past_the_engine_blocks_is_reused_and_priced_at_the_tier_speed():
    reuse = prefill_reuse(REQUEST, worker("u0", cached_blocks=10, tier_host_blocks=30, tier_disk_blocks=5), MODEL)
    assert (reuse.tokens, reuse.tier_tokens, reuse.tier_disk_tokens) == (45 * BLOCK, 35 * BLOCK, 5 * BLOCK)
    host, disk = MODEL.tier_loads["host"], MODEL.tier_loads["disk"]
    assert reuse.tier_seconds == cost.transfer_seconds(30 * BYTES, host) + cost.transfer_seconds(5 * BYTES, disk)


def test_the_last_prompt_token_is_never_loaded():
    reuse = prefill_reuse(REQUEST, worker("u0", tier_host_blocks=60), MODEL)
    assert reuse.tokens == 56 * BLOCK < REQUEST.prompt_tokens  # 899 // 16 = 56 loadable blocks


def test_nothing_is_loaded_past_blocks_still_being_computed_for_a_request_ahead():
    queued_owner = worker("u0", cached_blocks=20, followable_blocks=2, tier_host_blocks=30)
    assert prefill_reuse(REQUEST, queued_owner, MODEL).tier_tokens == 0


def test_a_local_plan_on_a_store_hit_beats_a_cold_worker_and_its_estimate_shows_the_load():
    cold, tiered = worker("u0"), worker("u1", tier_host_blocks=50)
    decision = CacheAwarePlanner(PlannerSettings()).decide(REQUEST, [cold, tiered], [cold, tiered], MODEL)
    chosen = decision.chosen
    assert (chosen.kind, chosen.decode_worker) == (PlanKind.LOCAL, "u1")
    estimate = chosen.estimate
    assert estimate.tier_tokens == 50 * BLOCK and estimate.reused_tokens == 50 * BLOCK
    assert 0 < estimate.tier_load < estimate.ttft
    cold_plan = local_plan(REQUEST, cold, MODEL, PlannerSettings())
    assert estimate.ttft < cold_plan.estimate.ttft
    assert f"u1 holds 0/57 blocks, loads 50 from host of its node store ({estimate.tier_load:.3f} s)" \
        in decision.reason


def test_an_engine_hit_beats_the_same_blocks_in_a_slow_store():
    slow = replace(MODEL, tier_loads={"host": LinkEstimate(bandwidth_bytes_per_second=1e6, latency_seconds=0.5)})
    engine, store = worker("u0", cached_blocks=50), worker("u1", tier_host_blocks=50)
    decision = CacheAwarePlanner(PlannerSettings()).decide(REQUEST, [engine, store], [engine, store], slow)
    assert decision.chosen.decode_worker == "u0"


def test_a_pulling_sink_does_not_count_on_its_store():
    source = worker("u0", cached_blocks=40)
    sink = worker("u1", tier_host_blocks=50)
    plan = pull_plan(REQUEST, source, sink, MODEL, PlannerSettings())
    assert plan.estimate.tier_tokens == 0 and plan.estimate.reused_tokens == 40 * BLOCK


def test_tier_loads_are_calibrated_per_tier_from_what_requests_report():
    calibration = Calibration()
    for blocks in (10, 40, 20, 50):
        calibration.observe_tier_load("host", blocks * BYTES, 0.1 + blocks * BYTES / 1e9)
    fitted = calibration.calibrated_model().tier_loads
    assert abs(fitted["host"].bandwidth_bytes_per_second - 1e9) / 1e9 < 0.01
    assert abs(fitted["host"].latency_seconds - 0.1) < 0.005
    assert fitted["disk"] == MODEL.tier_loads["disk"], "a tier without loads keeps its start-up estimate"


def test_a_record_tells_a_store_miss_from_an_index_or_claim_miss():
    def record(reused: int, tier: int) -> DecisionRecord:
        result = DecisionRecord("chatcmpl-1", 0, "r1", "cache_aware", 900, BLOCK, predicted_reused_tokens=800,
                                reason="", chosen=None, alternatives=[], predicted_stored_tokens=160,
                                predicted_tier_tokens=640)
        result.actual.reused_tokens, result.actual.tier_tokens = reused, tier
        return result

    assert record(reused=160, tier=0).tier_overestimated()  # the engine had its part; the store gave nothing
    assert not record(reused=160, tier=0).claim_overestimated()
    assert not record(reused=800, tier=640).tier_overestimated()
    assert record(reused=32, tier=0).index_overestimated() and not record(reused=32, tier=0).tier_overestimated()


def test_a_worker_whose_store_holds_the_prompt_survives_pruning_among_busier_and_colder_ones():
    others = [worker(f"u{n}", num_running=1, cached_blocks=n % 3) for n in range(12)]
    tiered = worker("tiered", num_running=2, tier_host_blocks=50)
    kept = prune([*others, tiered], top_k=2, problem=lambda view: "")
    assert "tiered" in {view.worker_id for view in kept}, "its store's run counts as held for pruning"
