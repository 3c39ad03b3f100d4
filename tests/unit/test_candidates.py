"""Pruning asks only the workers that can make the top-K, and answers as asking all would."""

import random

import pytest

from orchestrator.planner.candidates import load_key, prune, prune_exhaustively
from orchestrator.planner.plans import decode_problem_for
from orchestrator.planner.pools import LazyPool
from orchestrator.planner.settings import PlannerSettings
from orchestrator.planner.views import RequestView, WorkerView

REQUEST = RequestView("r1", prompt_tokens=900, expected_output_tokens=64, block_size=16)
SETTINGS = PlannerSettings(top_k=4)


def random_pool(rng: random.Random, size: int, holders: float, unable: float) -> list[WorkerView]:
    """Workers with random loads; ``holders`` of them hold part of the prompt, ``unable`` lack room."""
    return [WorkerView(f"w{i:04d}", "decode", num_running=rng.randint(0, 6), num_waiting=rng.randint(0, 2),
                       num_queued_prefill_tokens=rng.choice([0, 0, rng.randint(0, 3000)]),
                       num_free_blocks=0 if rng.random() < unable else 1000, num_total_blocks=1000,
                       block_size=16, bytes_per_block=16 * 23_040, in_flight=rng.randint(0, 8),
                       cached_blocks=rng.randint(1, 57) if rng.random() < holders else 0)
            for i in range(size)]


@pytest.mark.parametrize("seed", range(40))
def test_pruning_lazily_keeps_exactly_the_workers_asking_all_would(seed):
    rng = random.Random(seed)
    pool = random_pool(rng, rng.choice([3, 9, 20, 200, 1000]), holders=rng.choice([0.0, 0.01, 0.3]),
                       unable=rng.choice([0.0, 0.5, 0.97, 1.0]))
    asked = []

    def problem(worker):
        asked.append(worker.worker_id)
        return decode_problem_for(REQUEST, SETTINGS)(worker)

    kept = prune(pool, SETTINGS.top_k, problem)
    lazily_asked = len(asked)
    assert [w.worker_id for w in kept] == [w.worker_id for w in prune_exhaustively(pool, SETTINGS.top_k, problem)]
    able = sum(not problem(w) for w in pool)
    if len(pool) >= 200 and able == len(pool):
        assert lazily_asked < len(pool) / 4  # holders and the lightest few, not the whole pool


def test_unable_workers_are_kept_only_when_too_few_can_take_the_request():
    pool = random_pool(random.Random(3), 1000, holders=0.0, unable=0.999)
    kept = prune(pool, SETTINGS.top_k, decode_problem_for(REQUEST, SETTINGS))
    problem = decode_problem_for(REQUEST, SETTINGS)
    able = [w for w in pool if not problem(w)]
    assert len(able) < SETTINGS.top_k and set(w.worker_id for w in able) <= set(w.worker_id for w in kept)



def lazy(pool: list[WorkerView]) -> LazyPool:
    return LazyPool([load_key(w) for w in pool], [w.cached_blocks for w in pool], lambda i: pool[i])


@pytest.mark.parametrize("seed", range(20))
def test_a_lazy_pool_prunes_to_the_same_workers_building_only_those_it_asks_about(seed):
    rng = random.Random(100 + seed)
    pool = random_pool(rng, rng.choice([9, 200, 1000]), holders=rng.choice([0.0, 0.01, 0.3]),
                       unable=rng.choice([0.0, 0.5, 1.0]))
    asked = []

    def problem(worker):
        asked.append(worker.worker_id)
        return decode_problem_for(REQUEST, SETTINGS)(worker)

    views = lazy(pool)
    kept = prune(views, SETTINGS.top_k, problem)
    assert views.num_built == len(set(asked))  # a view is built when its worker is asked about, once
    assert [w.worker_id for w in kept] == [w.worker_id for w in prune(pool, SETTINGS.top_k, problem)]
    if len(pool) >= 200 and not any(problem(w) for w in pool):
        assert views.num_built < len(pool) / 4


def test_a_lazy_pool_builds_each_view_once_and_reads_like_a_list():
    pool = random_pool(random.Random(7), 5, holders=0.5, unable=0.0)
    built = []
    views = LazyPool([load_key(w) for w in pool], [w.cached_blocks for w in pool],
                     lambda i: built.append(i) or pool[i], built={4: pool[4]})
    assert (len(views), views.num_built) == (5, 1)
    assert views[1] is pool[1] and views[1] is pool[1] and views[-1] is pool[4]
    assert built == [1]  # the 5th was given already
    assert views[1:3] == pool[1:3] and list(views) == pool and built == [1, 2, 0, 3]
    with pytest.raises(IndexError):
        views[5]
    with pytest.raises(ValueError, match="for every worker"):
        LazyPool([load_key(pool[0])], [], lambda i: pool[i])
