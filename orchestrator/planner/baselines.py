"""Baseline policies, beside the cache-aware planner so every benchmark can compare them.

All of them prefill on a prefill worker and decode on a decode worker (DISAGG), or, where
the worker they pick to prefill is a unified one, serve the request there (LOCAL), as the
routers they imitate serve it on one aggregated replica. They skip
workers that cannot take the request when any other can, and fill the plan's estimate
with the same cost model, so decision records line up. Like the routers they imitate,
they route even when no worker has room: the plan is then marked infeasible, with the
reason, but still chosen (the engine queues it); only an empty pool yields no plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.planner.candidates import load_key, match_key
from orchestrator.planner.cost_model import CostModel, active_requests
from orchestrator.planner.plans import (
    decode_problem_for,
    describe,
    disagg_plan,
    held_blocks,
    local_plan,
    prefill_worker_problem,
    prompt_blocks,
)
from orchestrator.planner.settings import PlannerSettings
from orchestrator.planner.views import UNIFIED, Decision, RequestView, WorkerView

Pick = Callable[[list[WorkerView]], tuple[WorkerView, str]]  # a worker and why


def able_or_all(workers: list[WorkerView], problem: Callable[[WorkerView], str]) -> list[WorkerView]:
    able = [worker for worker in workers if not problem(worker)]
    return able or list(workers)


def baseline_decision(name: str, request: RequestView, prefill: list[WorkerView], decode: list[WorkerView],
                      model: CostModel, settings: PlannerSettings, pick_prefill: Pick, pick_decode: Pick) -> Decision:
    if not prefill or not decode:
        return Decision(name, None, (), "no feasible plan: no prefill or decode worker available")
    source, why_source = pick_prefill(able_or_all(prefill, lambda w: prefill_worker_problem(w, settings)))
    if source.role == UNIFIED:
        plan = local_plan(request, source, model, settings)
        reason = f"{describe(plan)}: {why_source}; a unified worker decodes what it prefills"
    else:
        sink, why_sink = pick_decode(able_or_all(decode, decode_problem_for(request, settings)))
        plan = disagg_plan(request, source, sink, model, settings)
        reason = f"{describe(plan)}: {why_source}; {why_sink}"
    if not plan.feasible:
        reason += f"; routed anyway: {plan.infeasible_reason}"
    return Decision(name, plan, (plan,), reason)


def least_loaded_pick(workers: list[WorkerView]) -> tuple[WorkerView, str]:
    worker = min(workers, key=load_key)
    return worker, f"{worker.worker_id} least loaded ({active_requests(worker)} active)"


class RoundRobin:
    """Cycles through each pool in worker-id order. Holds one counter, advanced per decision."""

    name = "round_robin"

    def __init__(self, settings: PlannerSettings | None = None, turn: int = 0):
        self.settings = settings or PlannerSettings()
        self.turn = turn

    def decide(self, request: RequestView, prefill: list[WorkerView], decode: list[WorkerView],
               model: CostModel) -> Decision:
        turn, self.turn = self.turn, self.turn + 1

        def pick(workers: list[WorkerView]) -> tuple[WorkerView, str]:
            worker = sorted(workers, key=lambda w: w.worker_id)[turn % len(workers)]
            return worker, f"{worker.worker_id} in turn {turn}"

        return baseline_decision(self.name, request, prefill, decode, model, self.settings, pick, pick)


class LeastLoaded:
    name = "least_loaded"

    def __init__(self, settings: PlannerSettings | None = None):
        self.settings = settings or PlannerSettings()

    def decide(self, request: RequestView, prefill: list[WorkerView], decode: list[WorkerView],
               model: CostModel) -> Decision:
        return baseline_decision(self.name, request, prefill, decode, model, self.settings,
                                 least_loaded_pick, least_loaded_pick)


@dataclass(frozen=True)
class AffinitySettings:
    """SGLang router's cache-aware defaults."""

    cache_threshold: float = 0.3  # least share of the prompt a worker must hold to attract it
    balance_abs_threshold: int = 64  # loads differing by at most this many requests are balanced...
    balance_rel_threshold: float = 1.5  # ...as are loads whose max is at most this times the min


def is_balanced(loads: list[int], affinity: AffinitySettings) -> bool:
    low, high = min(loads), max(loads)
    return high - low <= affinity.balance_abs_threshold or high <= affinity.balance_rel_threshold * low


class PrefixAffinity:
    """SGLang-router style: the best prefix match while load is balanced, else least loaded.
    The decode worker is the least loaded."""

    name = "prefix_affinity"

    def __init__(self, settings: PlannerSettings | None = None, affinity: AffinitySettings | None = None):
        self.settings = settings or PlannerSettings()
        self.affinity = affinity or AffinitySettings()

    def decide(self, request: RequestView, prefill: list[WorkerView], decode: list[WorkerView],
               model: CostModel) -> Decision:
        return baseline_decision(self.name, request, prefill, decode, model, self.settings,
                                 lambda workers: self.pick_prefill(request, workers), least_loaded_pick)

    def pick_prefill(self, request: RequestView, workers: list[WorkerView]) -> tuple[WorkerView, str]:
        best = min(workers, key=match_key)
        ratio = held_blocks(request, best) / prompt_blocks(request)
        if ratio < self.affinity.cache_threshold:
            worker, why = least_loaded_pick(workers)
            return worker, f"best match {ratio:.0%} below {self.affinity.cache_threshold:.0%}, {why}"
        if not is_balanced([active_requests(worker) for worker in workers], self.affinity):
            worker, why = least_loaded_pick(workers)
            return worker, f"load imbalanced, {why}"
        return best, f"{best.worker_id} best match ({ratio:.0%} of the prompt), load balanced"


def block_cost(request: RequestView, worker: WorkerView) -> int:
    """Dynamo's selector: blocks still to prefill after overlap credit, plus blocks in use."""
    to_prefill = prompt_blocks(request) - held_blocks(request, worker)
    return to_prefill + worker.num_total_blocks - worker.num_free_blocks


class BlockCost:
    """Dynamo KV-router style: the lowest block cost in each pool wins."""

    name = "block_cost"

    def __init__(self, settings: PlannerSettings | None = None):
        self.settings = settings or PlannerSettings()

    def decide(self, request: RequestView, prefill: list[WorkerView], decode: list[WorkerView],
               model: CostModel) -> Decision:
        def pick(workers: list[WorkerView]) -> tuple[WorkerView, str]:
            worker = min(workers, key=lambda w: (block_cost(request, w), w.worker_id))
            return worker, f"{worker.worker_id} lowest block cost ({block_cost(request, worker)})"

        return baseline_decision(self.name, request, prefill, decode, model, self.settings, pick, pick)
