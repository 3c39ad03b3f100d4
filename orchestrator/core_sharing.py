"""Which busy engines share a CPU core with each worker, for the planner's views.

A worker whose engine is bound to particular cores says so in its heartbeats
(``worker.cores``). Engines on one machine whose cores overlap take turns on
them, so a prefill planned on one of them runs slower while the others compute
(``orchestrator.planner.cost_model.contention_seconds``). Only busy engines are
attached: an idle one takes nothing from its neighbours, and leaving it out keeps the
views small. Cost: one pass to group the busy engines by core, then each bound
worker's cores; nothing at all when no worker reports a binding.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace

from foundation import wire
from orchestrator.planner.cost_model import active_requests
from orchestrator.planner.views import WorkerView


def is_busy(view: WorkerView) -> bool:
    """Computing now or about to: requests running, waiting or sent to it, or prompts queued."""
    return active_requests(view) > 0 or view.num_queued_prefill_tokens > 0


def with_core_neighbours(views: Sequence[WorkerView],
                         bindings: Mapping[str, wire.CoreBinding | None]) -> list[WorkerView]:
    """``views`` with each bound worker's busy core neighbours among ``views`` attached."""
    busy_on: dict[tuple[str, int], list[WorkerView]] = defaultdict(list)
    for view in views:
        binding = bindings.get(view.worker_id)
        if binding is not None and is_busy(view):
            for core in binding.cores:
                busy_on[(binding.machine, core)].append(view)
    if not busy_on:
        return list(views)
    return [_attach(view, bindings.get(view.worker_id), busy_on) for view in views]


def _attach(view: WorkerView, binding: wire.CoreBinding | None,
            busy_on: Mapping[tuple[str, int], list[WorkerView]]) -> WorkerView:
    if binding is None:
        return view
    neighbours = {other.worker_id: other for core in binding.cores
                  for other in busy_on.get((binding.machine, core), ()) if other.worker_id != view.worker_id}
    return replace(view, core_neighbours=tuple(neighbours.values())) if neighbours else view
