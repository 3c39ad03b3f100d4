"""Pruning a pool to the few workers worth costing, so decisions stay flat at 1,000 workers.

A worker is worth costing if it holds much of the prompt (reuse) or is lightly loaded
(an idle worker may beat a warm but busy one). We keep the union of the top-K by each.
Workers that cannot take the request rank after all that can, so they show up only when
too few can, and then carry the reason why not.

Asking a worker why it cannot take the request costs more than its load key, and only
the lightest-loaded few and the workers holding part of the prompt can make the top-K.
So ``prune`` orders the pool in two heaps, by load and (for the workers holding part of
the prompt) by match, and asks down each only until it has ``top_k`` able workers; the
best matches are topped up with the lightest able workers that hold nothing, as in the
full ranking. Where too few can take the request, it asks every worker
(``prune_exhaustively``, the full ranking itself). Given a ``LazyPool``, it reads the
keys the pool carries and builds only the views it asks about.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence

from orchestrator.planner.cost_model import active_requests
from orchestrator.planner.pools import LazyPool, LoadKey
from orchestrator.planner.views import WorkerView

Problem = Callable[[WorkerView], str]  # why a worker cannot take the request; "" when it can


def load_key(worker: WorkerView) -> LoadKey:
    """Least loaded first: active requests, then queued prefill tokens, then id for determinism."""
    return active_requests(worker), worker.num_queued_prefill_tokens, worker.worker_id


def match_key(worker: WorkerView) -> tuple[int, tuple[int, int, str]]:
    """Longest prefix within reach first (engine and node store); the lighter load breaks ties."""
    return -worker.reachable_blocks, load_key(worker)


def prune(workers: Sequence[WorkerView], top_k: int, problem: Problem) -> list[WorkerView]:
    """At most 2 x ``top_k`` workers: the best matches and the least loaded, able ones first."""
    pool = workers if isinstance(workers, LazyPool) else list(workers)
    if len(pool) <= 2 * top_k:
        return prune_exhaustively(list(pool), top_k, problem)
    loads, cached = pool_keys(pool)  # loads end with the worker id: no two tie
    able = _AbleInOrder(pool, problem, [(load, index) for index, load in enumerate(loads)])
    holders = _AbleInOrder(pool, problem, [(-blocks, loads[index], index)
                                           for index, blocks in enumerate(cached) if blocks > 0])
    lightest = able.first(top_k, lambda index: True)
    best_matches = holders.first(top_k, lambda index: True)
    best_matches += able.first(top_k - len(best_matches), lambda index: cached[index] == 0)
    if len(lightest) < top_k or len(best_matches) < top_k:  # too few can: the others may rank
        return prune_exhaustively(list(pool), top_k, problem)
    return unique_workers(pool[index] for index in best_matches + lightest)


def pool_keys(pool: Sequence[WorkerView]) -> tuple[list[LoadKey], list[int]]:
    """Every worker's load key and cached blocks: as a ``LazyPool`` carries them, else off the views."""
    if isinstance(pool, LazyPool):
        return pool.load_keys, pool.cached_blocks
    return [load_key(worker) for worker in pool], [worker.reachable_blocks for worker in pool]


class _AbleInOrder:
    """Positions of able workers in key order, each worker asked at most once, and only
    as far down the order as a caller reads."""

    def __init__(self, pool: Sequence[WorkerView], problem: Problem, keyed: list[tuple]):
        self._pool, self._problem, self._heap = pool, problem, keyed
        heapq.heapify(self._heap)
        self._found: list[int] = []

    def first(self, count: int, wanted: Callable[[int], bool]) -> list[int]:
        """The first ``count`` able positions that are ``wanted`` (fewer if the pool runs out)."""
        chosen = [index for index in self._found if wanted(index)][:count]
        while len(chosen) < count and self._heap:
            index = heapq.heappop(self._heap)[-1]
            if not self._problem(self._pool[index]):
                self._found.append(index)
                if wanted(index):
                    chosen.append(index)
        return chosen


def prune_exhaustively(pool: list[WorkerView], top_k: int, problem: Problem) -> list[WorkerView]:
    """``prune``'s answer, asking every worker whether it can take the request."""
    # Keys are computed once per worker and compared as plain tuples: a key callback per
    # comparison is what dominated the decision time at 1,000 workers.
    rows = [(bool(problem(worker)), load_key(worker), -worker.reachable_blocks, index)
            for index, worker in enumerate(pool)]
    by_load = heapq.nsmallest(top_k, ((unable, load, index) for unable, load, _, index in rows))
    by_match = heapq.nsmallest(top_k, ((unable, match, load, index) for unable, load, match, index in rows))
    return unique_workers(pool[row[-1]] for row in by_match + by_load)


def unique_workers(workers: Iterable[WorkerView]) -> list[WorkerView]:
    kept: dict[str, WorkerView] = {}
    for worker in workers:
        kept.setdefault(worker.worker_id, worker)
    return list(kept.values())
