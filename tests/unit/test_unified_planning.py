"""Unified workers in the planner: one engine in both pools, serving alone (LOCAL), prefilling
for another replica (DISAGG between replicas), lending a prefix it holds to another replica
that computes the rest (PULL), or decoding what another prefilled."""

from __future__ import annotations

import pytest

from foundation import wire
from orchestrator.decisions import plan_summary
from orchestrator.planner.cost_model import CostModel, neighbour_busy_seconds
from orchestrator.planner.planner import CacheAwarePlanner
from orchestrator.planner.policies import POLICIES, make_policy
from orchestrator.planner.views import UNIFIED, PlanKind, RequestView, WorkerView

BLOCK = 16
REQUEST = RequestView("r1", prompt_tokens=900, expected_output_tokens=64, block_size=BLOCK)  # 57 blocks
MODEL = CostModel()


def unified(worker_id: str, **fields) -> WorkerView:
    defaults = dict(num_running=0, num_waiting=0, num_queued_prefill_tokens=0, num_free_blocks=1000,
                    num_total_blocks=1000, block_size=BLOCK, bytes_per_block=BLOCK * 23_040)
    return WorkerView(worker_id, UNIFIED, **{**defaults, **fields})


def decide(pool: list[WorkerView], policy: str = "cache_aware"):
    return make_policy(policy).decide(REQUEST, pool, pool, MODEL)


def test_a_unified_worker_is_in_both_pools_and_no_other_role_is():
    assert [pool for pool in wire.POOLS if wire.serves(UNIFIED, pool)] == ["prefill", "decode"]
    assert [pool for pool in wire.POOLS if wire.serves("prefill", pool)] == ["prefill"]
    assert [pool for pool in wire.POOLS if wire.serves("decode", pool)] == ["decode"]


def test_one_unified_worker_serves_alone_and_never_hands_off_to_itself():
    decision = decide([unified("u0")])
    assert decision.chosen.kind is PlanKind.LOCAL and decision.chosen.decode_worker == "u0"
    assert [plan.kind for plan in decision.alternatives] == [PlanKind.LOCAL]


def test_every_pair_of_two_replicas_is_costed_both_ways():
    decision = decide([unified("u0"), unified("u1")])
    pairs = {(plan.prefill_worker, plan.decode_worker) for plan in decision.alternatives
             if plan.kind is PlanKind.DISAGG}
    assert pairs == {("u0", "u1"), ("u1", "u0")}


def test_an_idle_replica_holding_the_prompt_serves_it_itself():
    decision = decide([unified("u0"), unified("u1", cached_blocks=57)])
    assert (decision.chosen.kind, decision.chosen.decode_worker) == (PlanKind.LOCAL, "u1")
    assert decision.chosen.estimate.reused_tokens == REQUEST.prompt_tokens - 1  # the last token is always computed


def test_a_replica_busy_decoding_serves_a_prompt_it_holds_whole_itself():
    # One token to compute costs its running decodes less than any hand-off costs the request.
    decision = decide([unified("u0"), unified("u1", cached_blocks=57, num_running=6)])
    assert (decision.chosen.kind, decision.chosen.decode_worker) == (PlanKind.LOCAL, "u1")


def test_a_replica_busy_decoding_lends_the_prefix_it_holds_to_an_idle_one():
    decision = decide([unified("u0"), unified("u1", cached_blocks=40, num_running=6)])
    chosen = decision.chosen
    assert (chosen.kind, chosen.source_worker, chosen.decode_worker) == (PlanKind.PULL, "u1", "u0")
    assert chosen.lend_tokens == 40 * BLOCK and chosen.estimate.reused_tokens == 40 * BLOCK
    assert chosen.estimate.transfer_bytes == 40 * BLOCK * 23_040 and chosen.estimate.gap == 0.0
    assert chosen.workers == ("u1", "u0") and chosen.prefilling_worker == "u0"
    assert "u1 lends 40/57 blocks" in decision.reason
    # Prefilling the other 17 blocks on u1 would stall its six decodes: the DISAGG plan says so.
    (disagg,) = [p for p in decision.alternatives if p.kind is PlanKind.DISAGG and p.prefill_worker == "u1"]
    assert disagg.estimate.interference > chosen.estimate.interference


def test_an_idle_replica_holding_part_of_the_prompt_computes_the_rest_itself():
    decision = decide([unified("u0"), unified("u1", cached_blocks=40)])
    assert (decision.chosen.kind, decision.chosen.decode_worker) == (PlanKind.LOCAL, "u1")


def test_a_pull_is_costed_only_into_a_unified_worker_that_holds_less_of_the_prompt():
    decision = decide([unified("u0", cached_blocks=40), unified("u1", cached_blocks=40, num_running=6)])
    assert PlanKind.PULL not in {plan.kind for plan in decision.alternatives}
    decode = WorkerView("d0", "decode", 0, 0, 0, 1000, 1000, BLOCK, BLOCK * 23_040)
    warm = unified("u1", cached_blocks=40, num_running=6)
    decision = make_policy("cache_aware").decide(REQUEST, [warm], [decode, warm], MODEL)
    assert PlanKind.PULL not in {plan.kind for plan in decision.alternatives}


def test_a_pull_never_lends_the_last_token():
    whole = unified("u1", cached_blocks=57, num_running=6)
    (pull,) = [p for p in decide([unified("u0"), whole]).alternatives if p.kind is PlanKind.PULL]
    assert pull.lend_tokens == (REQUEST.prompt_tokens - 1) // BLOCK * BLOCK  # 56 blocks: 896 tokens


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"cache_aware", "local_only"}))
def test_baselines_serve_a_request_on_the_unified_replica_they_pick(policy):
    decision = decide([unified("u0"), unified("u1", cached_blocks=57)], policy)
    assert decision.chosen.kind is PlanKind.LOCAL
    assert "a unified worker decodes what it prefills" in decision.reason


def test_baselines_hand_off_from_a_prefill_worker_to_a_unified_one():
    prefill = WorkerView("p0", "prefill", 0, 0, 0, 1000, 1000, BLOCK, BLOCK * 23_040)
    decision = make_policy("round_robin").decide(REQUEST, [prefill], [unified("u0")], MODEL)
    assert (decision.chosen.kind, decision.chosen.workers) == (PlanKind.DISAGG, ("p0", "u0"))


def test_a_busy_unified_neighbour_counts_as_decoding_throughout():
    assert neighbour_busy_seconds(MODEL, unified("u0", num_running=1)) == float("inf")
    assert neighbour_busy_seconds(MODEL, unified("u0")) == 0.0


def test_the_cache_aware_planner_is_the_default_policy_class():
    assert isinstance(make_policy("cache_aware"), CacheAwarePlanner)


def test_a_pull_is_recorded_with_its_source_and_lent_tokens():
    chosen = decide([unified("u0"), unified("u1", cached_blocks=40, num_running=6)]).chosen
    summary = plan_summary(chosen)
    assert (summary["kind"], summary["source_worker"], summary["lend_tokens"]) == ("pull", "u1", 40 * BLOCK)
    assert summary["prefill_worker"] is None and summary["decode_worker"] == "u0"


def test_a_replica_decoding_a_batch_of_long_answers_still_takes_requests():
    # 40 streams is a modest vLLM batch: the cap is vLLM's own batch limit, not a guess below it.
    decision = decide([unified("u0", cached_blocks=57, num_running=40, in_flight=40)])
    assert (decision.chosen.kind, decision.chosen.decode_worker) == (PlanKind.LOCAL, "u0")
