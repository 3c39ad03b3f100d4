"""The aggregated-serving baseline: no disaggregation at all.

``local_only`` sends every request to one decode worker, which prefills and decodes it
(LOCAL), as a data-parallel router in front of plain engines would: the decode worker
holding the longest prefix of the prompt, the least loaded among equals. It is the
"recompute" side of a transfer-vs-recompute comparison, and the aggregated point of
reference for the disaggregated policies. Like the other baselines it routes even when
no worker has room, marking the plan infeasible.
"""

from __future__ import annotations

from orchestrator.planner.baselines import able_or_all
from orchestrator.planner.candidates import match_key
from orchestrator.planner.cost_model import CostModel
from orchestrator.planner.plans import decode_problem_for, describe, held_blocks, local_plan
from orchestrator.planner.settings import PlannerSettings
from orchestrator.planner.views import Decision, RequestView, WorkerView


class LocalOnly:
    name = "local_only"

    def __init__(self, settings: PlannerSettings | None = None):
        self.settings = settings or PlannerSettings()

    def decide(self, request: RequestView, prefill: list[WorkerView], decode: list[WorkerView],
               model: CostModel) -> Decision:
        if not decode:
            return Decision(self.name, None, (), "no feasible plan: no decode worker available")
        able = able_or_all(decode, decode_problem_for(request, self.settings))
        worker = min(able, key=match_key)
        plan = local_plan(request, worker, model, self.settings)
        reason = (f"{describe(plan)}: aggregated serving, {held_blocks(request, worker)} prompt blocks "
                  f"resident there")
        if not plan.feasible:
            reason += f"; routed anyway: {plan.infeasible_reason}"
        return Decision(self.name, plan, (plan,), reason)
