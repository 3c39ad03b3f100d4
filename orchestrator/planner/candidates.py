"""Pruning a pool to the few workers worth costing, so decisions stay flat at 1,000 workers.

A worker is worth costing if it holds much of the prompt (reuse) or is lightly loaded
(an idle worker may beat a warm but busy one). We keep the union of the top-K by each,
found with ``heapq.nsmallest`` (O(n log k), no full sort). Workers that cannot take the
request rank after all that can, so they show up only when too few can, and then carry
the reason why not.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterable

from orchestrator.planner.cost_model import active_requests
from orchestrator.planner.views import WorkerView

Problem = Callable[[WorkerView], str]  # why a worker cannot take the request; "" when it can


def load_key(worker: WorkerView) -> tuple[int, int, str]:
    """Least loaded first: active requests, then queued prefill tokens, then id for determinism."""
    return active_requests(worker), worker.num_queued_prefill_tokens, worker.worker_id


def match_key(worker: WorkerView) -> tuple[int, tuple[int, int, str]]:
    """Longest prefix match first; the lighter load breaks ties."""
    return -worker.cached_blocks, load_key(worker)


def prune(workers: Iterable[WorkerView], top_k: int, problem: Problem) -> list[WorkerView]:
    """At most 2 x ``top_k`` workers: the best matches and the least loaded, able ones first."""
    pool = list(workers)
    # Keys are computed once per worker and compared as plain tuples: a key callback per
    # comparison is what dominated the decision time at 1,000 workers.
    rows = [(bool(problem(worker)), load_key(worker), -worker.cached_blocks, index)
            for index, worker in enumerate(pool)]
    by_load = heapq.nsmallest(top_k, ((unable, load, index) for unable, load, _, index in rows))
    by_match = heapq.nsmallest(top_k, ((unable, match, load, index) for unable, load, match, index in rows))
    return unique_workers(pool[row[-1]] for row in by_match + by_load)


def unique_workers(workers: Iterable[WorkerView]) -> list[WorkerView]:
    kept: dict[str, WorkerView] = {}
    for worker in workers:
        kept.setdefault(worker.worker_id, worker)
    return list(kept.values())
