"""The cache-aware policy: weigh reuse on a busy worker against recompute on an idle one,
in seconds (docs/placement.md). Pure: everything it needs is passed in.

    prune pools -> enumerate LOCAL and DISAGG plans -> estimate + mark infeasible -> rank -> explain

Ranking: by least TTFT (plus the interference a LOCAL prefill causes, which counts in full
the seconds it pushes running decodes past their TPOT targets, and the delay a
prefill adds to the prompts queued on a worker that shares its steps), where a plan
whose hand-off gap exceeds the bound is charged its whole gap as well. A gap within the
bound is free; one past it costs what it costs, so a plan just over the bound still
beats one that makes the client wait many times longer for its first token (a strict
"within the bound first" order sent every request of an overloaded cluster to the one
decode worker, whose LOCAL plans have no gap). Plans within the tie band of the
cheapest (``PlannerSettings.tie_band``, 10%) are ties, and go to the plan reusing the
most cached tokens, then to the one whose prefilling worker's cache is emptier, then the
cheaper, the smaller gap, the lighter load and worker ids. A hit that waits for a busy
decode worker ties with a cold prefill that waits as long, and the hit computes a
fraction of it. The prompt's blocks stay cached where it is prefilled, so
near-equal placements of new prefixes fill the pool's caches evenly instead of evicting
one worker's other prefixes (which a smaller but noisy link-estimate gap did, and then
a worker measured 4% faster than one not yet measured: one worker took most new prefixes).
"""

from __future__ import annotations

from orchestrator.planner.candidates import load_key, prune
from orchestrator.planner.cost_model import CostModel
from orchestrator.planner.plans import (
    decode_problem_for,
    describe,
    disagg_plan,
    held_blocks,
    lendable_blocks,
    local_plan,
    prefill_worker_problem,
    prompt_blocks,
    pull_plan,
)
from orchestrator.planner.settings import PlannerSettings
from orchestrator.planner.views import UNIFIED, Decision, Estimate, Plan, PlanKind, RequestView, WorkerView

POLICY_NAME = "cache_aware"
TIE_RESOLUTION_SECONDS = 6  # decimal places: costs closer than a microsecond are a tie
CACHE_FILL_RESOLUTION = 2  # decimal places: caches filled within a percent are equally full


class CacheAwarePlanner:
    name = POLICY_NAME

    def __init__(self, settings: PlannerSettings | None = None):
        self.settings = settings or PlannerSettings()

    def decide(self, request: RequestView, prefill: list[WorkerView], decode: list[WorkerView],
               model: CostModel) -> Decision:
        return plan_request(request, prefill, decode, model, self.settings)


def plan_request(request: RequestView, prefill: list[WorkerView], decode: list[WorkerView],
                 model: CostModel, settings: PlannerSettings) -> Decision:
    prefill_candidates = prune(prefill, settings.top_k, lambda w: prefill_worker_problem(w, settings))
    decode_candidates = prune(decode, settings.top_k, decode_problem_for(request, settings))
    plans = enumerate_plans(request, prefill_candidates, decode_candidates, model, settings)
    views = {worker.worker_id: worker for worker in prefill_candidates + decode_candidates}
    ranked = rank(plans, views, settings)
    chosen = ranked[0] if ranked else None
    return Decision(POLICY_NAME, chosen, tuple(plans), explain(request, plans, ranked, views, settings))


def enumerate_plans(request: RequestView, prefill: list[WorkerView], decode: list[WorkerView],
                    model: CostModel, settings: PlannerSettings) -> list[Plan]:
    """Every LOCAL plan on a decode candidate, then every prefill x decode DISAGG pair of two
    workers (a unified worker is in both pools; prefilling for itself is its LOCAL plan), then
    every PULL into a unified worker from one that holds more of the prompt than it does."""
    local = [local_plan(request, worker, model, settings) for worker in decode]
    pairs = [(source, sink) for source in prefill for sink in decode if source.worker_id != sink.worker_id]
    disagg = [disagg_plan(request, source, sink, model, settings) for source, sink in pairs]
    pulls = [pull_plan(request, source, sink, model, settings) for source, sink in pairs
             if sink.role == UNIFIED and lendable_blocks(request, source) > min(sink.reusable_blocks,
                                                                                 prompt_blocks(request))]
    return local + disagg + pulls


def rank(plans: list[Plan], views: dict[str, WorkerView], settings: PlannerSettings) -> list[Plan]:
    """Feasible plans, best first: among those within the tie band of the cheapest, the
    emptiest cache first; the rest by cost."""
    ranked = sorted((plan for plan in plans if plan.feasible), key=lambda plan: ranking_key(plan, views, settings))
    if not ranked:
        return ranked
    limit = ranking_seconds(ranked[0], settings) * (1 + settings.tie_band)
    tied = [plan for plan in ranked if ranking_seconds(plan, settings) <= limit]
    rest = ranked[len(tied):]  # sorted by cost, so the tied plans are the leading ones
    return sorted(tied, key=lambda plan: tie_key(plan, views, settings)) + rest


def tie_key(plan: Plan, views: dict[str, WorkerView], settings: PlannerSettings) -> tuple:
    """Among plans the estimates cannot tell apart: the one computing least (most reused
    blocks) leaves the most compute to the requests after it; among equal reuse (a new
    prefix), the emptiest cache; then by cost."""
    return (-plan.estimate.reused_tokens, cache_fill(plan, views), ranking_key(plan, views, settings))


def ranking_seconds(plan: Plan, settings: PlannerSettings) -> float:
    """What a plan costs: its TTFT, what it costs others (running decodes it stalls,
    queued prompts it delays), and its gap if over the bound."""
    estimate = plan.estimate
    over_bound = estimate.gap > settings.gap_bound_seconds
    return (estimate.ttft + estimate.interference + estimate.queue_delay
            + (estimate.gap if over_bound else 0.0))


def cache_fill(plan: Plan, views: dict[str, WorkerView]) -> float:
    """How full the prefilling worker's cache is, to a percent."""
    return round(views[plan.prefilling_worker].cache_fill, CACHE_FILL_RESOLUTION)


def ranking_key(plan: Plan, views: dict[str, WorkerView], settings: PlannerSettings) -> tuple:
    load = [load_key(views[worker_id])[:2] for worker_id in plan.workers]
    total_load = (sum(active for active, _ in load), sum(queued for _, queued in load))
    return (round(ranking_seconds(plan, settings), TIE_RESOLUTION_SECONDS), cache_fill(plan, views),
            round(plan.estimate.gap, TIE_RESOLUTION_SECONDS), total_load, plan.prefill_worker or "", plan.decode_worker,
            plan.source_worker or "")


def explain(request: RequestView, plans: list[Plan], ranked: list[Plan], views: dict[str, WorkerView],
            settings: PlannerSettings) -> str:
    if not ranked:
        return no_plan_reason(plans)
    chosen = ranked[0]
    reason = f"{describe(chosen)}: {holdings(chosen, request, views)}; est. {timing(chosen)}"
    if chosen.estimate.gap > settings.gap_bound_seconds:
        reason += f"; its gap is over the {settings.gap_bound_seconds:.2f} s gap bound and charged in full"
    if len(ranked) > 1:
        runner_up = ranked[1]
        reason += (f"; vs TTFT {runner_up.estimate.ttft:.3f} s for {describe(runner_up)} "
                   f"({holdings(runner_up, request, views)}, queue {runner_up.estimate.queue_wait:.3f} s"
                   f"{charges(runner_up)})")
        reason += tie_reason(chosen, runner_up, views, settings)
    return reason + tpot_reason(chosen, ranked, settings)


def tpot_reason(chosen: Plan, ranked: list[Plan], settings: PlannerSettings) -> str:
    """Names the TPOT charge where it decided: the plan that would have been cheapest without
    it pushes running decodes past their TPOT targets. Empty where it did not decide."""
    def untargeted(plan: Plan) -> float:
        return ranking_seconds(plan, settings) - plan.estimate.tpot_charge

    cheapest = min(ranked, key=untargeted)
    if cheapest is chosen or untargeted(cheapest) >= untargeted(chosen):
        return ""
    return (f"; TPOT targets decide: {describe(cheapest)} would cost {untargeted(cheapest):.3f} s but push running "
            f"decodes {cheapest.estimate.tpot_overrun:.3f} s past their targets, charged in full")


def tie_reason(chosen: Plan, runner_up: Plan, views: dict[str, WorkerView], settings: PlannerSettings) -> str:
    """Why the chosen plan beat a cheaper-or-equal runner-up within the tie band; empty if it did not."""
    if ranking_seconds(chosen, settings) < ranking_seconds(runner_up, settings):
        return ""
    band = f"; within {settings.tie_band:.0%} of the cheapest, so "
    if chosen.estimate.reused_tokens > runner_up.estimate.reused_tokens:
        return band + (f"the plan reusing more wins ({chosen.estimate.reused_tokens} cached tokens against "
                       f"{runner_up.estimate.reused_tokens})")
    if cache_fill(chosen, views) < cache_fill(runner_up, views):
        return band + (f"the emptier cache wins ({cache_fill(chosen, views):.0%} full against "
                       f"{cache_fill(runner_up, views):.0%})")
    return ""


def holdings(plan: Plan, request: RequestView, views: dict[str, WorkerView]) -> str:
    if plan.kind is PlanKind.PULL:
        lent = lendable_blocks(request, views[plan.source_worker])
        held = min(views[plan.decode_worker].reusable_blocks, lent)
        return (f"{plan.source_worker} lends {lent}/{prompt_blocks(request)} blocks, {plan.decode_worker} "
                f"holds {held} of them and pulls {lent - held}")
    prefiller = plan.prefilling_worker
    total = prompt_blocks(request)
    held = held_blocks(request, views[prefiller])
    text = f"{prefiller} holds {held}/{total} blocks"
    reusable = min(views[prefiller].reusable_blocks, held)
    if reusable < held:
        text += f" (reuses {reusable}: the rest is claimed by a prompt queued behind another)"
    text += tier_part(plan.estimate, request)
    if plan.kind is PlanKind.DISAGG:
        missing = total - held_blocks(request, views[plan.decode_worker])
        text += f", {plan.decode_worker} pulls {missing}"
    return text


def tier_part(estimate: Estimate, request: RequestView) -> str:
    """The blocks the prefill loads from its node store, by tier, and the load's estimate."""
    if not estimate.tier_tokens:
        return ""
    disk = estimate.tier_disk_tokens // request.block_size
    host = estimate.tier_tokens // request.block_size - disk
    tiers = " + ".join(f"{count} from {tier}" for tier, count in (("host", host), ("disk", disk)) if count)
    return f", loads {tiers} of its node store ({estimate.tier_load:.3f} s)"


def timing(plan: Plan) -> str:
    estimate = plan.estimate
    text = f"TTFT {estimate.ttft:.3f} s (queue {estimate.queue_wait:.3f} s), gap {estimate.gap:.3f} s"
    if estimate.contention > 0:
        text += f", {estimate.contention:.3f} s of it for engines sharing its cores"
    return text + charges(plan)


def charges(plan: Plan) -> str:
    """What the plan costs other requests, charged when ranking it."""
    estimate, text = plan.estimate, ""
    if estimate.interference > 0:
        past = f", {estimate.tpot_overrun:.3f} s past their TPOT targets" if estimate.tpot_overrun > 0 else ""
        text += f", stalls running decodes {estimate.stall:.3f} s in all{past} (charged {estimate.interference:.3f} s)"
    if estimate.queue_delay > 0:
        text += f", delays queued prompts by {estimate.queue_delay:.3f} s"
    return text


def no_plan_reason(plans: list[Plan]) -> str:
    if not plans:
        return "no feasible plan: no prefill or decode worker available"
    problems = list(dict.fromkeys(plan.infeasible_reason for plan in plans))
    shown = "; ".join(problems[:4]) + ("; …" if len(problems) > 4 else "")
    return f"no feasible plan among {len(plans)}: {shown}"
