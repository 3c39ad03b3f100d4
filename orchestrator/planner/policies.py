"""Policies by name, so the orchestrator and every benchmark select one with a string.

Each policy object answers ``decide(request, prefill, decode, model) -> Decision``;
round_robin holds a turn counter, the others hold only their settings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from orchestrator.planner.aggregated import LocalOnly
from orchestrator.planner.baselines import BlockCost, LeastLoaded, PrefixAffinity, RoundRobin
from orchestrator.planner.cost_model import CostModel
from orchestrator.planner.planner import CacheAwarePlanner
from orchestrator.planner.settings import PlannerSettings
from orchestrator.planner.views import Decision, RequestView, WorkerView


class Policy(Protocol):
    name: str

    def decide(self, request: RequestView, prefill: list[WorkerView], decode: list[WorkerView],
               model: CostModel) -> Decision: ...


POLICIES: dict[str, Callable[[PlannerSettings], Policy]] = {
    "cache_aware": CacheAwarePlanner,
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "prefix_affinity": PrefixAffinity,
    "block_cost": BlockCost,
    "local_only": LocalOnly,
}


def make_policy(name: str, settings: PlannerSettings | None = None) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](settings or PlannerSettings())
