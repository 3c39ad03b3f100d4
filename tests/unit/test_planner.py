"""Table tests for the cache-aware planner: reuse on a busy worker vs recompute on an idle one."""

import random
from dataclasses import replace

import pytest

from orchestrator.planner.cost_model import CostModel, LinkEstimate
from orchestrator.planner.planner import CacheAwarePlanner
from orchestrator.planner.settings import PlannerSettings
from orchestrator.planner.views import PlanKind, RequestView, WorkerView

BLOCK = 16
REQUEST = RequestView("r1", prompt_tokens=900, expected_output_tokens=64, block_size=BLOCK)  # 57 blocks
PROMPT_BLOCKS = 57
MODEL = CostModel()
SLOW_LINK = LinkEstimate(bandwidth_bytes_per_second=10e6, latency_seconds=0.005)


def worker(worker_id: str, **fields) -> WorkerView:
    role = "prefill" if worker_id.startswith("p") else "decode"
    defaults = dict(num_running=0, num_waiting=0, num_queued_prefill_tokens=0, num_free_blocks=1000,
                    num_total_blocks=1000, block_size=BLOCK, bytes_per_block=BLOCK * 23_040)
    return WorkerView(worker_id, role, **{**defaults, **fields})


def decide(prefill, decode, model=MODEL, settings=None, request=REQUEST):
    return CacheAwarePlanner(settings).decide(request, prefill, decode, model)


BUSY_DECODE = worker("d0", num_running=4)  # a LOCAL prefill here would stall four streams


@pytest.mark.parametrize("warm_load, expected", [
    (dict(num_waiting=1, num_queued_prefill_tokens=500), "p1"),  # short queue < recompute saved
    (dict(num_running=2, in_flight=3), "p1"),
    (dict(num_waiting=4, num_queued_prefill_tokens=3000), "p0"),  # queue longer than a cold prefill
    (dict(in_flight=PlannerSettings().max_in_flight), "p0"),  # at the concurrency cap
    (dict(num_queued_prefill_tokens=16_384), "p0"),  # at the queued-token cap
])
def test_warm_worker_wins_only_while_its_queue_costs_less_than_the_recompute(warm_load, expected):
    cold_idle = worker("p0")
    warm = worker("p1", cached_blocks=50, **warm_load)
    decision = decide([cold_idle, warm], [BUSY_DECODE])
    assert decision.chosen.kind is PlanKind.DISAGG
    assert decision.chosen.prefill_worker == expected


def test_warm_worker_over_its_cap_is_reported_when_nothing_else_is_left():
    at_cap = worker("p1", cached_blocks=57, in_flight=PlannerSettings().max_in_flight)
    decision = decide([at_cap], [worker("d0", num_free_blocks=0)])
    assert decision.chosen is None
    reasons = {plan.infeasible_reason for plan in decision.alternatives}
    assert any("concurrency cap" in reason for reason in reasons)


@pytest.mark.parametrize("decode_cached, link, expected", [
    (55, None, PlanKind.LOCAL),  # decode worker holds most of the prompt: a small local prefill
    (0, SLOW_LINK, PlanKind.LOCAL),  # prefill worker is warm but the link would stall the stream
    (0, None, PlanKind.DISAGG),  # long uncached prompt, fast link: prefill elsewhere
])
def test_local_vs_disagg(decode_cached, link, expected):
    prefill = worker("p0", cached_blocks=57 if link else 0)
    decode = worker("d0", cached_blocks=decode_cached, num_running=0 if link or decode_cached else 4)
    model = CostModel(links={("p0", "d0"): link}) if link else MODEL
    assert decide([prefill], [decode], model).chosen.kind is expected


@pytest.mark.parametrize("running, expected", [(0, PlanKind.LOCAL), (4, PlanKind.DISAGG)])
def test_local_prefill_on_a_busy_decode_worker_is_penalised(running, expected):
    # d0 holds half the prompt: cheaper to finish it there, unless that stalls its running streams
    decision = decide([worker("p0")], [worker("d0", cached_blocks=30, num_running=running)])
    assert decision.chosen.kind is expected
    local = next(plan for plan in decision.alternatives if plan.kind is PlanKind.LOCAL)
    assert local.estimate.ttft < 0.3 and (local.estimate.interference > 0) == (running > 0)


def test_disagg_pulls_only_the_blocks_the_decode_worker_lacks():
    decision = decide([worker("p0", cached_blocks=57)], [worker("d0", cached_blocks=40, num_running=4)])
    assert decision.chosen.kind is PlanKind.DISAGG
    assert decision.chosen.estimate.transfer_bytes == (PROMPT_BLOCKS - 40) * BLOCK * 23_040
    assert "p0 holds 57/57 blocks" in decision.reason and "d0 pulls 17" in decision.reason


@pytest.mark.parametrize("decode_workers, expected", [
    ([worker("d0", cached_blocks=57, num_free_blocks=0), worker("d1", num_free_blocks=100)], "d1"),
    ([worker("d0", num_free_blocks=60), worker("d1", num_free_blocks=61, num_running=2)], "d1"),
    # 57 held + 4 free covers 61 blocks: the held prefix counts as free
    ([worker("d0", cached_blocks=57, num_free_blocks=4), worker("d1")], "d0"),
])
def test_never_a_decode_worker_without_room(decode_workers, expected):
    decision = decide([worker("p0", cached_blocks=57)], decode_workers)
    assert decision.chosen.decode_worker == expected


def test_no_decode_worker_with_room_means_no_plan():
    decision = decide([worker("p0")], [worker("d0", num_free_blocks=10), worker("d1", num_free_blocks=0)])
    assert decision.chosen is None
    assert "no feasible plan" in decision.reason and "lacks room" in decision.reason
    assert decision.alternatives and not any(plan.feasible for plan in decision.alternatives)


def test_a_plan_over_the_gap_bound_loses_to_a_slower_one_within_it():
    links = {("p0", "d0"): SLOW_LINK}  # warm p0: fast TTFT, but ~2 s to ship the prompt
    decision = decide([worker("p0", cached_blocks=57), worker("p1")], [worker("d0", num_running=4)],
                      CostModel(links=links))
    fast_but_stalling = next(plan for plan in decision.alternatives if plan.prefill_worker == "p0")
    assert fast_but_stalling.estimate.ttft < decision.chosen.estimate.ttft
    assert decision.chosen.prefill_worker == "p1"


def test_when_every_gap_is_over_the_bound_least_ttft_plus_gap_wins():
    links = {("p0", "d0"): LinkEstimate(3e9, 1.0), ("p1", "d0"): LinkEstimate(3e9, 0.3)}
    decode = worker("d0", num_queued_prefill_tokens=1)  # LOCAL is off: queue at its cap
    decision = decide([worker("p0", cached_blocks=57), worker("p1")], [decode], CostModel(links=links),
                      PlannerSettings(max_queued_prefill_tokens=1))
    assert decision.chosen.prefill_worker == "p1"  # TTFT 0.38 + gap 0.33 beats 0.05 + 1.03
    assert "gap bound" in decision.reason


FLAT_MODEL = CostModel(interleave_seconds_per_active=0.0)  # load no longer changes any estimate
EVEN_PREFILL = [worker("p2"), worker("p0", num_running=1), worker("p1"), worker("p3", num_running=1)]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("decode, model, expected", [
    # idle decode workers: LOCAL and DISAGG tie on TTFT; LOCAL has no gap; d0 before d1 by id
    ([worker("d1"), worker("d0")], FLAT_MODEL, ("d0",)),
    # busy decode workers make LOCAL dear; every DISAGG pair ties on TTFT and gap, so the
    # lighter prefill workers (p1, p2) win over p0 and p3, and p1 before p2 by id
    ([worker("d1", num_running=1), worker("d0", num_running=1)],
     CostModel(interleave_seconds_per_active=0.0, local_interference_weight=1.0), ("p1", "d0")),
])
def test_ties_are_broken_by_load_then_worker_id_whatever_the_input_order(seed, decode, model, expected):
    prefill, decode = list(EVEN_PREFILL), list(decode)
    random.Random(seed).shuffle(prefill)
    random.Random(seed).shuffle(decode)
    assert decide(prefill, decode, model).chosen.workers == expected


def test_warm_workers_at_their_cap_do_not_crowd_out_the_next_best_match():
    at_cap = [worker(f"p{i}", cached_blocks=57, in_flight=PlannerSettings().max_in_flight) for i in range(4)]
    cold = [worker(f"p{i}") for i in range(5, 100)]
    decision = decide(at_cap + cold + [worker("p4", cached_blocks=50)], [BUSY_DECODE])
    assert decision.chosen.prefill_worker == "p4"


def test_every_alternative_carries_an_estimate():
    decision = decide([worker("p0"), worker("p1", cached_blocks=20, in_flight=PlannerSettings().max_in_flight)],
                      [worker("d0"), worker("d1", num_free_blocks=0)])
    assert len(decision.alternatives) == 2 + 2 * 2
    for plan in decision.alternatives:
        assert plan.estimate is not None and plan.estimate.ttft >= plan.estimate.prefill > 0
        assert plan.feasible == (plan.infeasible_reason == "")


def large_fleet(seed: int = 11, size: int = 1000):
    rng = random.Random(seed)

    def pool(prefix):
        return [worker(f"{prefix}{i:04d}", cached_blocks=rng.randint(0, 20), num_running=rng.randint(0, 6),
                       num_queued_prefill_tokens=rng.randint(0, 2000)) for i in range(size)]

    prefill, decode = pool("p"), pool("d")
    prefill[537] = worker("p0537", cached_blocks=57, num_running=3)  # the one warm worker, mid-pool
    return prefill, decode


def test_pruning_keeps_the_best_match_among_a_thousand_and_stays_flat():
    prefill, decode = large_fleet()
    settings = PlannerSettings(top_k=4)
    decision = decide(prefill, decode, settings=settings)
    assert decision.chosen.prefill_worker == "p0537"
    k = settings.top_k
    assert len(decision.alternatives) <= 2 * k * (2 * k + 1)


def test_a_gap_just_over_the_bound_does_not_lose_to_a_far_longer_ttft():
    """An overloaded decode worker's LOCAL plan has no gap but a long queue; a cold prefill
    worker whose hand-off is slightly over the bound must still win."""
    links = {("p0", "d0"): LinkEstimate(3e8, 0.1)}  # a slow link: the gap is ~0.35 s
    decode = worker("d0", num_waiting=8, num_queued_prefill_tokens=12_000)
    decision = decide([worker("p0")], [decode], CostModel(links=links))
    assert decision.chosen.kind is PlanKind.DISAGG
    local = next(plan for plan in decision.alternatives if plan.kind is PlanKind.LOCAL)
    chosen = decision.chosen.estimate
    assert chosen.gap > 0.25 and chosen.ttft + chosen.gap < local.estimate.ttft


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("prefill, decode, expected", [
    # a new prefix, equal costs: the emptier prefill cache takes it, not the one holding more
    ([worker("p0", resident_blocks=900), worker("p1", resident_blocks=100)], [BUSY_DECODE], ("p1", "d0")),
    # LOCAL and DISAGG tie on TTFT (idle decode worker); its cache is fuller, so DISAGG
    ([worker("p0", resident_blocks=100)], [worker("d0", resident_blocks=800)], ("p0", "d0")),
    # ... and LOCAL when the decode worker's cache is the emptier one
    ([worker("p0", resident_blocks=800)], [worker("d0", resident_blocks=100)], ("d0",)),
    # fill never outweighs cost: the full cache that holds the prompt still wins
    ([worker("p0", resident_blocks=950, cached_blocks=50), worker("p1")], [BUSY_DECODE], ("p0", "d0")),
    # caches within a percent of each other are equally full: load, then id, decide
    ([worker("p1", resident_blocks=503), worker("p0", resident_blocks=498)], [BUSY_DECODE], ("p0", "d0")),
])
def test_equal_cost_placements_go_to_the_emptier_cache(seed, prefill, decode, expected):
    prefill = list(prefill)
    random.Random(seed).shuffle(prefill)
    model = CostModel(interleave_seconds_per_active=0.0, local_interference_weight=1.0)
    decision = decide(prefill, decode, model)
    assert decision.chosen.workers == expected, decision.reason
    if expected == ("p1", "d0"):
        assert "the emptier cache wins (10% full against 90%)" in decision.reason


@pytest.mark.parametrize("cold_queue_tokens, expected", [
    (100, "p1"),  # ~8% dearer than the fuller cache: within the 10% band, the emptier cache takes it
    (400, "p0"),  # ~33% dearer: cost wins
])
def test_near_equal_placements_go_to_the_emptier_cache_within_the_tie_band(cold_queue_tokens, expected):
    full = worker("p0", resident_blocks=900)
    empty = worker("p1", resident_blocks=100, num_waiting=0, num_queued_prefill_tokens=cold_queue_tokens)
    model = CostModel(interleave_seconds_per_active=0.0, local_interference_weight=1.0)
    decision = decide([full, empty], [BUSY_DECODE], model)
    assert decision.chosen.prefill_worker == expected, decision.reason
    strict = decide([full, empty], [BUSY_DECODE], model, settings=PlannerSettings(tie_band=0.0))
    assert strict.chosen.prefill_worker == "p0"


def test_a_decode_worker_busy_prefilling_delays_the_second_token_of_plans_pulling_to_it():
    """Measured: DISAGG hits estimated at 0.06-0.23 s of gap waited 1.8-4.6 s for the
    decode worker's LOCAL prefill to end."""
    prefilling = worker("d0", num_queued_prefill_tokens=4000)  # ~1.2 s of its own prefill left
    decision = decide([worker("p0", cached_blocks=57)], [prefilling])
    hit = next(plan for plan in decision.alternatives + (decision.chosen,) if plan.prefill_worker == "p0")
    assert hit.estimate.gap > 1.0
    assert hit.estimate.gap == pytest.approx(
        hit.estimate.transfer + MODEL.decode_step_seconds + 4000 * MODEL.prefill.per_token_seconds
        - hit.estimate.ttft - hit.estimate.transfer, rel=1e-6)


def test_within_the_tie_band_the_plan_reusing_more_wins_over_the_emptier_cache():
    """Both wait as long for the busy decode worker; the hit computes a fraction of the cold one."""
    prefilling = worker("d0", num_queued_prefill_tokens=6000, resident_blocks=999)  # LOCAL: queued, full
    warm = worker("p0", cached_blocks=57, resident_blocks=900)
    cold = worker("p1", resident_blocks=0)
    decision = decide([warm, cold], [prefilling], settings=PlannerSettings(tie_band=0.2))
    costs = {plan.prefill_worker: plan.estimate.ttft + plan.estimate.gap
             for plan in (decision.chosen,) + decision.alternatives}
    assert costs["p0"] >= costs["p1"] and costs["p0"] <= 1.2 * costs["p1"]
    assert decision.chosen.prefill_worker == "p0", decision.reason
    assert "the plan reusing more wins" in decision.reason


def test_cache_fill_is_the_indexed_share_of_the_cache():
    assert worker("p0", resident_blocks=250).cache_fill == 0.25
    assert worker("p0", num_total_blocks=0).cache_fill == 0.0


@pytest.mark.parametrize("speeds, expected", [
    ({}, "p1"),  # equal speeds: the emptier cache takes the new prefix
    ({"p1": 1.3}, "p0"),  # p1 measured 30% slower than its class: the fuller but faster p0
    ({"p0": 0.8}, "p0"),
])
def test_a_worker_measured_slower_loses_an_otherwise_equal_placement(speeds, expected):
    model = CostModel(prefill_speed=speeds)
    prefill = [worker("p0", resident_blocks=900), worker("p1", resident_blocks=100)]
    decision = decide(prefill, [BUSY_DECODE], model)
    assert decision.chosen.prefill_worker == expected, decision.reason



def cold_prompts_queued(*tokens: int) -> dict:
    return dict(num_waiting=len(tokens), num_queued_prefill_tokens=sum(tokens), queued_prompts=tokens,
                prompt_step_cap=256)


def test_a_cold_prompt_goes_where_it_delays_no_queued_prompt():
    """Prefill workers sharing their steps: a cold 900-token prompt behind two queued
    short ones would reach its first token sooner than on a worker slowed to half speed
    by a neighbour, but it would share steps with the second of them and delay it: the
    two together lose more than the slowed worker costs."""
    busy = worker("p0", **cold_prompts_queued(30, 650))
    slowed = worker("p1", core_neighbours=(worker("d9", num_running=2),))
    decision = decide([busy, slowed], [BUSY_DECODE])
    by_worker = {plan.prefill_worker: plan.estimate for plan in decision.alternatives if plan.prefill_worker}
    assert by_worker["p0"].ttft < by_worker["p1"].ttft  # the busy worker alone would be chosen
    assert by_worker["p0"].queue_delay > 0 and by_worker["p1"].queue_delay == 0
    assert decision.chosen.prefill_worker == "p1"
    # the record says what a plan costs the queued prompts, chosen or runner-up
    assert "delays queued prompts by" in decide([busy], [BUSY_DECODE]).reason


def test_a_short_hit_still_joins_a_warm_worker_sharing_steps_with_cold_prompts():
    """A hit computes a few tokens: behind the oldest prompt it takes little from the
    others and gets its first token long before they end, where waiting in turn prices it
    behind all of them (the cold idle worker then wins and recomputes the prefix)."""
    warm = worker("p0", cached_blocks=PROMPT_BLOCKS, **cold_prompts_queued(100, 1200))
    decision = decide([warm, worker("p1")], [BUSY_DECODE])
    assert decision.chosen.prefill_worker == "p0"
    assert decision.chosen.estimate.queue_delay < 0.3
    in_turn = decide([replace(warm, prompt_step_cap=0), worker("p1")], [BUSY_DECODE])
    assert in_turn.chosen.prefill_worker == "p1"


def test_a_hit_behind_a_cold_prompt_computing_alone_waits_for_all_of_it():
    """A prompt alone takes whole steps: a hit arriving meanwhile waits for its end, so a
    long cold prompt there sends the hit to recompute on an idle worker."""
    warm = worker("p0", cached_blocks=PROMPT_BLOCKS, **cold_prompts_queued(3000))
    assert decide([warm, worker("p1")], [BUSY_DECODE]).chosen.prefill_worker == "p1"
