"""Table tests for the baseline policies and the policy registry."""

import pytest

from orchestrator.planner.baselines import AffinitySettings, PrefixAffinity, RoundRobin, block_cost
from orchestrator.planner.cost_model import CostModel
from orchestrator.planner.policies import POLICIES, make_policy
from orchestrator.planner.settings import PlannerSettings
from orchestrator.planner.views import PlanKind, RequestView, WorkerView

BLOCK = 16
REQUEST = RequestView("r1", prompt_tokens=800, expected_output_tokens=64, block_size=BLOCK)  # 50 blocks
MODEL = CostModel()
ROOMY = PlannerSettings(max_in_flight=1000)  # lets the load tables go past the default cap


def worker(worker_id: str, **fields) -> WorkerView:
    role = "prefill" if worker_id.startswith("p") else "decode"
    defaults = dict(num_running=0, num_waiting=0, num_queued_prefill_tokens=0, num_free_blocks=1000,
                    num_total_blocks=1000, block_size=BLOCK, bytes_per_block=BLOCK * 23_040)
    return WorkerView(worker_id, role, **{**defaults, **fields})


def chosen_workers(policy, prefill, decode):
    return policy.decide(REQUEST, prefill, decode, MODEL).chosen.workers


def test_round_robin_cycles_each_pool_in_id_order():
    policy = RoundRobin()
    prefill = [worker("p1"), worker("p0"), worker("p2")]
    decode = [worker("d1"), worker("d0")]
    picks = [chosen_workers(policy, prefill, decode) for _ in range(4)]
    assert picks == [("p0", "d0"), ("p1", "d1"), ("p2", "d0"), ("p0", "d1")]


def test_round_robin_skips_workers_without_room():
    policy = RoundRobin(turn=1)
    decode = [worker("d0"), worker("d1", num_free_blocks=0), worker("d2")]
    assert chosen_workers(policy, [worker("p0")], decode) == ("p0", "d2")


@pytest.mark.parametrize("prefill, decode, expected", [
    ([worker("p0", num_running=3), worker("p1", num_running=1)], [worker("d0"), worker("d1")], ("p1", "d0")),
    ([worker("p0", num_waiting=2), worker("p1", in_flight=2, num_queued_prefill_tokens=10)],
     [worker("d0", num_running=5), worker("d1", num_running=2)], ("p0", "d1")),
    # the least loaded decode worker has no room for the prompt and output: skip it
    ([worker("p0")], [worker("d0", num_free_blocks=10), worker("d1", num_running=4)], ("p0", "d1")),
])
def test_least_loaded(prefill, decode, expected):
    assert chosen_workers(make_policy("least_loaded"), prefill, decode) == expected


@pytest.mark.parametrize("prefill, expected", [
    # balanced and p1 holds 40% of the prompt (>= 30%): affinity wins though p1 is busier
    ([worker("p0"), worker("p1", cached_blocks=20, num_running=3)], "p1"),
    # best match below the threshold: least loaded
    ([worker("p0", num_running=1), worker("p1", cached_blocks=10, num_running=3), worker("p2")], "p2"),
    # imbalanced (100 - 10 > 64 and 100 > 1.5 x 10): least loaded, despite the full match
    ([worker("p0", num_running=10), worker("p1", cached_blocks=50, num_running=100)], "p0"),
    # a difference over 64 but within 1.5x is still balanced
    ([worker("p0", num_running=200), worker("p1", cached_blocks=50, num_running=280)], "p1"),
])
def test_prefix_affinity(prefill, expected):
    decode = [worker("d0", num_running=2), worker("d1", num_running=1)]
    decision = PrefixAffinity(ROOMY).decide(REQUEST, prefill, decode, MODEL)
    assert decision.chosen.workers == (expected, "d1")


def test_prefix_affinity_threshold_is_a_setting():
    prefill = [worker("p0"), worker("p1", cached_blocks=20, num_running=3)]
    strict = PrefixAffinity(ROOMY, AffinitySettings(cache_threshold=0.5))
    assert chosen_workers(strict, prefill, [worker("d0")]) == ("p0", "d0")


@pytest.mark.parametrize("fields, expected", [
    (dict(), 50),  # nothing held, nothing in use
    (dict(cached_blocks=30), 20),
    (dict(cached_blocks=30, num_free_blocks=900), 120),
    (dict(cached_blocks=80), 0),  # the index can report more than the prompt has
])
def test_block_cost_is_blocks_to_prefill_plus_blocks_in_use(fields, expected):
    assert block_cost(REQUEST, worker("p0", **fields)) == expected


def test_block_cost_picks_the_lowest_cost_in_each_pool():
    prefill = [worker("p0", cached_blocks=10), worker("p1", cached_blocks=40, num_free_blocks=960),
               worker("p2", cached_blocks=45, num_free_blocks=900)]
    decode = [worker("d0", num_free_blocks=500), worker("d1", cached_blocks=20, num_free_blocks=800)]
    # p0: 40 + 0, p1: 10 + 40, p2: 5 + 100; d0: 50 + 500, d1: 30 + 200
    assert chosen_workers(make_policy("block_cost"), prefill, decode) == ("p0", "d1")


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "prefix_affinity", "block_cost"])
def test_baselines_disaggregate_and_carry_estimates(name):
    decision = make_policy(name).decide(REQUEST, [worker("p0", cached_blocks=25)],
                                        [worker("d0", cached_blocks=10)], MODEL)
    plan = decision.chosen
    assert decision.policy == name and plan.kind is PlanKind.DISAGG and plan.feasible
    assert decision.alternatives == (plan,)
    assert plan.estimate.reused_tokens == 25 * BLOCK
    assert plan.estimate.transfer_bytes == 40 * BLOCK * 23_040
    assert plan.estimate.ttft > 0 and plan.estimate.gap > 0


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "prefix_affinity", "block_cost", "local_only"])
def test_baselines_route_anyway_when_no_decode_worker_has_room(name):
    decision = make_policy(name).decide(REQUEST, [worker("p0")], [worker("d0", num_free_blocks=0)], MODEL)
    assert not decision.chosen.feasible and "lacks room" in decision.reason


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_has_no_plan_without_workers(name):
    decision = make_policy(name).decide(REQUEST, [], [], MODEL)
    assert decision.chosen is None and decision.policy == name


def test_make_policy_knows_every_name_and_lists_them_on_a_typo():
    assert set(POLICIES) == {"cache_aware", "round_robin", "least_loaded", "prefix_affinity", "block_cost",
                             "local_only"}
    assert make_policy("cache_aware", PlannerSettings(top_k=2)).settings.top_k == 2
    with pytest.raises(ValueError, match="cache_aware, round_robin, least_loaded"):
        make_policy("random")


@pytest.mark.parametrize("decode, expected", [
    # the longest resident prefix wins, even on a busier worker
    ([worker("d0"), worker("d1", cached_blocks=30, num_running=3)], "d1"),
    # equal matches: the least loaded
    ([worker("d0", num_running=2), worker("d1", num_running=1)], "d1"),
    # the best match has no room for prompt and output: skip it
    ([worker("d0", cached_blocks=30, num_free_blocks=10), worker("d1")], "d1"),
])
def test_local_only_prefills_on_a_decode_worker(decode, expected):
    decision = make_policy("local_only").decide(REQUEST, [worker("p0", cached_blocks=50)], decode, MODEL)
    assert decision.chosen.kind is PlanKind.LOCAL
    assert decision.chosen.workers == (expected,)
    assert decision.chosen.estimate.transfer_bytes == 0


def test_local_only_without_decode_workers_has_no_plan():
    decision = make_policy("local_only").decide(REQUEST, [worker("p0")], [], MODEL)
    assert decision.chosen is None and "no decode worker" in decision.reason
