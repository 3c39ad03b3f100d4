"""The simulator: its vLLM-like engine, its conservation checks, determinism, and every policy."""

from __future__ import annotations

import heapq
import importlib
import json
from dataclasses import replace

import pytest

import simulator.events
from orchestrator.planner.candidates import load_key
from orchestrator.planner.cost_model import DEFAULT_PREFILL, prefill_seconds_with
from orchestrator.planner.policies import POLICIES
from orchestrator.planner.settings import PlannerSettings
from simulator import EngineConfig, SimCalibration, SimulationSettings, simulate
from simulator.block_pool import BlockPool, CapacityError
from simulator.engine import Engine
from simulator.events import EventQueue, TimeWentBackwards
from simulator.loop import AdmissionSettings
from simulator.records import FINISHED, REJECTED
from simulator.requests import TokenRequest, replay_requests
from simulator.sequence import RequestState
from tests.unit.sim_requests import BLOCK, SYNTHETIC, engine_request, tokens
from workloads import RepositoryAssistantConfig, generate_workload
from workloads.trace import TraceScaling, load_trace

SMALL_ENGINE = EngineConfig(num_blocks=600, block_size=BLOCK)  # room for ~1 long prompt: evictions, preemptions
SMALL = SimulationSettings(prefill_engine=SMALL_ENGINE, decode_engine=SMALL_ENGINE)


@pytest.fixture(scope="module")
def trace():
    """80 trace requests, squeezed into 8 s and 32-token blocks so they contend."""
    if not SYNTHETIC.exists():
        pytest.skip("shared/data not present")
    return load_trace(SYNTHETIC, TraceScaling(block_tokens=32, time_scale=0.01), limit=80)


def run_engine(engine: Engine, max_steps: int = 10_000) -> int:
    """Step ``engine`` until it is empty; the number of steps."""
    for step_number in range(max_steps):
        if engine.empty:
            return step_number
        step = engine.schedule()
        assert step.work, "an engine with requests must make progress"
        engine.complete(step, 0.0, 1.0)
    raise AssertionError("engine did not drain")


# ---------------------------------------------------------------- calibration


def test_a_whole_prefill_step_costs_what_the_planner_estimates():
    calibration = SimCalibration()
    for new, cached in ((900, 0), (100, 800), (1, 0)):
        expected = prefill_seconds_with(DEFAULT_PREFILL, new, cached)
        assert calibration.step_seconds([(new, cached)], 0) == pytest.approx(expected)
    assert calibration.step_seconds([], 1) == pytest.approx(0.020)  # the planner's decode step
    assert calibration.step_seconds([], 5) - calibration.step_seconds([], 4) == pytest.approx(0.005)
    model = calibration.cost_model()
    assert model.decode_step_seconds == pytest.approx(0.020)
    assert model.prefill == DEFAULT_PREFILL


def test_calibration_loads_from_json(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"prefill_per_token_seconds": 1e-3, "link_bandwidth_bytes_per_second": 1e8}))
    calibration = SimCalibration.from_json(path)
    assert calibration.prefill_per_token_seconds == 1e-3
    assert calibration.decode_per_sequence_seconds == SimCalibration().decode_per_sequence_seconds
    assert SimCalibration.from_dict(calibration.to_dict()) == calibration
    with pytest.raises(ValueError, match="unknown"):
        SimCalibration.from_dict({"prefil_seconds": 1})
    with pytest.raises(ValueError):
        SimCalibration(link_bandwidth_bytes_per_second=0)


# ---------------------------------------------------------------- block pool


def test_pool_evicts_least_recently_released_and_never_overfills():
    pool = BlockPool(4)
    pool.allocate(3)
    for key in (11, 12, 13):
        assert pool.promote(key)
    assert not pool.promote(11)  # already cached: a duplicate stays private
    pool.release([11, 12, 13])  # tail first: 13, 12, 11 become evictable in that order
    assert pool.num_free == 4 and pool.num_cached == 3
    pool.allocate(2)  # one never-cached block, then evicts 13
    assert pool.cached_prefix([11, 12, 13], 3) == 2
    assert [event.block_hashes for event in pool.take_events()] == [[13]]
    assert pool.take_events() == []
    with pytest.raises(CapacityError):
        pool.allocate(3)
    assert pool.max_used <= pool.num_total


def test_pool_releases_evict_first_blocks_to_the_front_tail_foremost_until_a_hit():
    pool = BlockPool(6)
    pool.allocate(2)
    for key in (1, 2):
        pool.promote(key)
    pool.release([1, 2])  # older, plain: LRU order 2, 1
    pool.allocate(3)
    for key in (21, 22, 23):
        pool.promote(key, evict_first=True)
    pool.release([21, 22, 23])  # newer, but first to go: 23, 22, 21, then 2, 1
    pool.allocate(6 - 2)  # 1 free block, then evicts 3
    assert [event.block_hashes for event in pool.take_events()] == [[23, 22, 21]]
    pool.release([None] * 4)

    pool.allocate(1)
    pool.promote(31, evict_first=True)
    pool.release([31])
    pool.acquire([31])  # a local hit: from now on plain LRU
    pool.release([31])  # order 2, 1, 31
    pool.allocate(6)
    assert [event.block_hashes for event in pool.take_events()] == [[2, 1, 31]]


@pytest.mark.parametrize("evict_pulled_first, survivor", [(True, "local"), (False, "pulled")])
def test_a_decode_engine_evicts_pulled_prompts_before_its_own_only_when_told(evict_pulled_first, survivor):
    engine = Engine(EngineConfig(num_blocks=10, block_size=BLOCK, evict_pulled_first=evict_pulled_first))
    local = engine_request("local", tokens(1, 64))  # prefilled here: 4 blocks
    engine.submit(local)
    run_engine(engine)
    pulled = engine_request("pulled", tokens(2, 64), max_tokens=2, num_output=1, remote=True)
    engine.submit(pulled)  # released after the local one: the more recent, in plain LRU
    engine.schedule()
    engine.pull_done(pulled)
    run_engine(engine)
    engine.submit(engine_request("squeeze", tokens(3, 48)))  # 3 blocks of 10: evicts 1 of the 8 cached
    run_engine(engine)
    kept = {name: engine.pool.cached_prefix(r.block_keys, 4) for name, r in (("local", local), ("pulled", pulled))}
    assert kept[survivor] == 4 and min(kept.values()) < 4, kept


# ---------------------------------------------------------------- engine


def test_a_repeated_prompt_hits_its_full_blocks_but_not_its_last_token():
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK))

    def cached_tokens(prompt: list[int]) -> int:
        request = engine_request(f"r{len(engine.pool.take_events())}", prompt)
        engine.submit(request)
        run_engine(engine)
        return request.cached_tokens

    prompt = tokens(1, 100)  # 6 full blocks + 4 tokens
    assert (cached_tokens(prompt), cached_tokens(prompt)) == (0, 96)
    exact = tokens(2, 96)  # exactly 6 blocks: the 6th holds the last token, recomputed
    assert (cached_tokens(exact), cached_tokens(exact)) == (0, 80)
    assert engine.pool.num_used == 0


def test_a_request_admitted_in_the_same_step_hits_the_blocks_scheduled_before_it():
    """As in vLLM, whose ``KVCacheManager.allocate_slots`` caches a chunk's full blocks when
    it schedules them: the forward pass writes each layer's KV before any request reads it."""
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK))
    for request_id in ("a", "b"):
        engine.submit(engine_request(request_id, tokens(1, 100)))
    first, second = list(engine.waiting)
    step = engine.schedule()
    assert [(r.request_id, new) for r, new in step.work] == [("a", 100), ("b", 4)]
    assert [event.block_hashes for event in engine.pool.take_events()] == [first.block_keys[:6]]
    run_engine(engine)
    assert (first.cached_tokens, second.cached_tokens) == (0, 96)


def test_a_prompt_is_capped_per_step_only_while_another_request_runs_or_waits():
    """vLLM's ``long_prefill_token_threshold``: alone, a prompt takes the whole budget."""
    engine = Engine(EngineConfig(num_blocks=256, block_size=BLOCK, long_prefill_tokens=64))
    engine.submit(engine_request("alone", tokens(1, 300)))
    assert [(r.request_id, new) for r, new in engine.schedule().work] == [("alone", 300)]
    run_engine(engine)
    engine.submit(engine_request("cold", tokens(2, 300)))
    engine.submit(engine_request("hit", tokens(1, 300)[:288] + tokens(3, 20)))
    step = engine.schedule()  # the hit recomputes 20 tokens beside a capped share of the cold prompt
    assert [(r.request_id, new) for r, new in step.work] == [("cold", 64), ("hit", 20)]
    with pytest.raises(ValueError, match="long_prefill_tokens"):
        EngineConfig(long_prefill_tokens=-1)


def test_a_request_whose_pulled_kv_landed_runs_even_behind_a_prompt_that_finds_no_blocks():
    """Nothing runs to free blocks: had the pulled request waited for the prompt ahead of it,
    neither would ever run (a 1,000-worker simulation ended with 31 requests stuck so)."""
    engine = Engine(EngineConfig(num_blocks=10, block_size=BLOCK))
    pulled = engine_request("pulled", tokens(1, 64), max_tokens=2, remote=True)
    engine.submit(pulled)
    assert engine.schedule().pulls  # its blocks are taken for the pull
    engine.pull_done(pulled)
    too_big = engine_request("too-big", tokens(2, 100))  # 7 blocks; 5 are free
    engine.submit(too_big)
    engine.waiting = [too_big, pulled]  # as when the prompt queued before the pull was started
    step = engine.schedule()
    assert [(r.request_id, new) for r, new in step.work] == [("pulled", 1)]
    assert too_big.state is RequestState.WAITING


def test_a_request_queued_behind_a_chunked_prefill_hits_every_chunk_scheduled_so_far():
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=256, max_num_seqs=8))
    prompt = tokens(1, 600)
    engine.submit(engine_request("leader", prompt))
    engine.complete(engine.schedule(), 0.0, 1.0)  # the first 256 tokens
    engine.submit(engine_request("follower", prompt))
    engine.complete(engine.schedule(), 1.0, 1.0)  # the leader's next 256: the budget is spent
    step = engine.schedule()  # the leader's last 88 tokens, then the follower on what is left
    assert [(r.request_id, new) for r, new in step.work] == [("leader", 88), ("follower", 8)]
    assert step.work[1][0].cached_tokens == 592  # all 37 full blocks, though the leader's last are being computed


def test_a_follower_of_a_prefix_queued_behind_another_prompt_reuses_one_chunk_of_it():
    """What ``orchestrator.followers`` prices: a prompt alone is one long step; the owner of
    a prefix and its follower, both arriving during it, are scheduled together after it,
    and the follower finds only the owner's first (capped) chunk."""
    engine = Engine(EngineConfig(num_blocks=256, block_size=BLOCK, long_prefill_tokens=64))
    engine.submit(engine_request("head", tokens(1, 300)))
    step = engine.schedule()
    assert [(r.request_id, new) for r, new in step.work] == [("head", 300)]
    prefix = tokens(2, 320)
    engine.submit(engine_request("owner", prefix + tokens(3, 10)))
    engine.submit(engine_request("follower", prefix + tokens(4, 10)))
    assert engine.queued_request_ids() == ("head", "owner", "follower")
    engine.complete(step, 0.0, 1.0)
    step = engine.schedule()
    assert [(r.request_id, new) for r, new in step.work][:2] == [("owner", 64), ("follower", 64)]
    assert step.work[1][0].cached_tokens == 64


def test_chunked_prefill_spreads_a_long_prompt_over_steps():
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=256, max_num_seqs=8))
    engine.submit(engine_request("long", tokens(1, 600), max_tokens=3))
    chunks = []
    while not engine.empty:
        step = engine.schedule()
        chunks.append([new for _, new in step.work])
        engine.complete(step, 0.0, 1.0)
    assert chunks[:3] == [[256], [256], [88]]  # then two decode steps (a run when allowed)
    assert sum(len(c) for c in chunks[3:]) >= 1


def test_decodes_share_steps_with_a_prefill_chunk():
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=64, max_num_seqs=8))
    engine.submit(engine_request("short", tokens(1, 10), max_tokens=20))
    step = engine.schedule()
    engine.complete(step, 0.0, 1.0)  # "short" is decoding now
    engine.submit(engine_request("long", tokens(2, 300), max_tokens=2))
    step = engine.schedule()
    assert [(r.request_id, new) for r, new in step.work] == [("short", 1), ("long", 63)]
    assert step.num_decodes() == 1 and step.prefill_chunks() == [(63, 0)]


def test_running_out_of_blocks_preempts_and_everything_still_finishes():
    engine = Engine(EngineConfig(num_blocks=12, block_size=BLOCK, max_num_seqs=4))
    for label in range(3):
        engine.submit(engine_request(f"r{label}", tokens(label, 40), max_tokens=60))
    requests = list(engine.waiting)
    run_engine(engine)
    assert engine.num_preemptions > 0
    assert all(r.state is RequestState.FINISHED and r.num_output == 60 for r in requests)
    assert engine.pool.num_used == 0 and engine.pool.max_used <= 12


def test_a_remote_request_pulls_only_what_the_local_cache_lacks():
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK))
    prompt = tokens(3, 70)  # 5 blocks, 4 of them full
    engine.submit(engine_request("warm", prompt[:48]))  # caches the first 3 blocks here
    run_engine(engine)
    request = engine_request("pulled", prompt, max_tokens=4, num_output=1, remote=True)
    engine.submit(request)
    step = engine.schedule()
    assert step.pulls == [(request, 5 - 3)] and not step.work
    assert request.state is RequestState.PULLING
    engine.pull_done(request)
    events = engine.pool.take_events()
    assert events[-1].block_hashes == request.block_keys[3:4]  # the 4th full block joins the cache
    run_engine(engine)
    assert request.num_output == 4 and engine.pool.num_used == 0


# ---------------------------------------------------------------- events


def test_the_clock_refuses_to_go_backwards():
    clock = EventQueue()
    seen = []
    clock.at(2.0, seen.append, "b")
    clock.at(1.0, seen.append, "a")
    clock.at(2.0, seen.append, "c")  # same time: scheduling order
    clock.run()
    assert seen == ["a", "b", "c"] and clock.now == 2.0
    with pytest.raises(TimeWentBackwards):
        clock.at(1.5, seen.append, "late")


# ---------------------------------------------------------------- whole simulations


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_conserves_requests_and_blocks(trace, policy, monkeypatch):
    popped: list[float] = []

    class RecordingHeap:  # the clock's heap, watched: every event's time as it is processed
        heappush = staticmethod(heapq.heappush)

        @staticmethod
        def heappop(heap):
            item = heapq.heappop(heap)
            popped.append(item[0])
            return item

    monkeypatch.setattr(simulator.events, "heapq", RecordingHeap)
    # All 80 requests arrive within 0.22 s: the last ones wait for capacity well past the
    # service's 10 s admission wait, which would answer them 429; here they wait it out.
    patient = replace(SMALL, admission=AdmissionSettings(wait_seconds=120.0))
    result = simulate(trace, policy, num_prefill=2, num_decode=2, settings=patient)
    records = result.records
    assert len(records) == trace.kept == len({r.request_id for r in records})
    assert sorted(r.index for r in records) == sorted(r.index for r in trace.requests)
    assert all(r.status == FINISHED for r in records)  # baselines always route; cache_aware waits
    assert popped == sorted(popped) and len(popped) == result.events
    for worker in result.workers:
        assert worker.max_blocks_used <= worker.num_blocks
    for record in records:
        assert 0 <= record.queue_seconds <= record.ttft_seconds <= record.e2e_seconds
        assert record.output_tokens == next(r.max_tokens for r in trace.requests if r.index == record.index)
        assert 0 <= record.cached_tokens < record.prompt_tokens
        assert record.plan in ("local", "disagg")
    assert result.summary.finished == len(records) and result.summary.ttft_p50 > 0


def test_same_seed_same_results_different_seed_different(trace):
    calibration = SimCalibration(step_jitter=0.2)
    one, two, other = (simulate(trace, "cache_aware", 2, 2, calibration, seed, SMALL) for seed in (5, 5, 6))
    assert one.records == two.records and one.summary == two.summary
    assert [r.e2e_seconds for r in one.records] != [r.e2e_seconds for r in other.records]


@pytest.mark.parametrize("policy", ["cache_aware", "block_cost"])
def test_decode_runs_change_nothing_at_step_boundaries(trace, policy):
    stepped = EngineConfig(num_blocks=600, block_size=BLOCK, decode_runs=False)
    by_step = simulate(trace, policy, 2, 2, settings=SimulationSettings(prefill_engine=stepped,
                                                                        decode_engine=stepped))
    by_run = simulate(trace, policy, 2, 2, settings=SMALL)
    assert by_run.events < by_step.events
    for run, step in zip(by_run.records, by_step.records):
        assert (run.request_id, run.decode_worker, run.prefill_worker, run.cached_tokens) == \
            (step.request_id, step.decode_worker, step.prefill_worker, step.cached_tokens)
        assert run.e2e_seconds == pytest.approx(step.e2e_seconds, abs=1e-6)


def test_requests_without_a_feasible_plan_wait_then_are_rejected_once():
    burst = [TokenRequest(i, 0.0, 50, tokens(i, 200)) for i in range(12)]
    settings = replace(SMALL, planner=PlannerSettings(max_in_flight=1),
                       admission=AdmissionSettings(wait_seconds=0.5, replan_seconds=0.25))
    result = simulate(burst, "cache_aware", 1, 1, settings=settings)
    statuses = [r.status for r in result.records]
    assert statuses.count(FINISHED) >= 1 and statuses.count(REJECTED) >= 1
    assert len(statuses) == 12 and result.summary.rejected == statuses.count(REJECTED)
    assert all(r.ttft_seconds is None for r in result.records if r.status == REJECTED)


def test_cache_aware_reuses_the_shared_repository_prefixes():
    workload = generate_workload(RepositoryAssistantConfig(repositories=4, requests=40, rate=4.0, seed=3,
                                                           prefix_min_tokens=400, prefix_max_tokens=800))
    settings = SimulationSettings(prefill_engine=EngineConfig(num_blocks=200), decode_engine=EngineConfig())
    aware = simulate(workload, "cache_aware", 4, 2, settings=settings).summary
    blind = simulate(workload, "round_robin", 4, 2, settings=settings).summary
    assert aware.hit_rate > blind.hit_rate
    assert aware.ttft_p50 < blind.ttft_p50


def test_workload_prompts_share_their_repository_prefix():
    workload = generate_workload(RepositoryAssistantConfig(repositories=2, requests=10, seed=1))
    requests = replay_requests(workload)
    same = [r for r, w in zip(requests, workload) if w.repository == workload[0].repository]
    other = next(r for r, w in zip(requests, workload) if w.repository != workload[0].repository)
    prefix = len(same[0].prompt_token_ids) - 70  # the question is at most 60 tokens
    assert same[0].prompt_token_ids[:prefix] == same[1].prompt_token_ids[:prefix]
    assert same[0].prompt_token_ids[3:20] != other.prompt_token_ids[3:20]


def test_a_request_larger_than_an_engine_is_refused_up_front():
    with pytest.raises(ValueError, match="blocks over its life"):
        simulate([TokenRequest(0, 0.0, 10, tokens(0, 600 * BLOCK))], settings=SMALL)


def test_queued_prefill_tokens_are_what_is_left_to_compute():
    """As a worker's heartbeat lists them: a prefill in progress counts what its finished
    steps have not computed, a warm request behind it only what its cache lacks."""
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=256, max_num_seqs=8))
    prompt = tokens(1, 600)
    engine.submit(engine_request("leader", prompt))
    assert engine.queued_prefill_tokens() == 600
    engine.complete(engine.schedule(), 0.0, 1.0)  # the first 256 tokens
    engine.submit(engine_request("follower", prompt + tokens(2, 40)))
    # The leader has 344 left; its first 256 tokens (16 blocks) are cached for the follower.
    assert engine.queued_prefill_tokens() == 344 + (640 - 256)
    assert engine.queued_prompts() == (344, 640 - 256)  # the planner prices them one by one
    step = engine.schedule()  # the leader's next 256: in progress, still counted
    assert engine.queued_prefill_tokens() == 344 + (640 - 512)
    engine.complete(step, 1.0, 1.0)
    assert engine.queued_prefill_tokens() == 88 + (640 - 512)
    run_engine(engine)
    assert engine.queued_prefill_tokens() == 0


def test_a_pulled_prompt_is_not_queued_prefill():
    engine = Engine(EngineConfig(num_blocks=64, block_size=BLOCK))
    engine.submit(engine_request("pulled", tokens(1, 100), remote=True, num_output=1))
    assert engine.queued_prefill_tokens() == 0


def test_the_pools_handed_to_the_policy_carry_the_keys_of_the_views_they_build(trace, monkeypatch):
    """The fleet re-reads the load keys of touched workers only: at every decision they must
    still be those of the views the pool builds."""
    checked = []

    class Checking:
        def __init__(self, policy):
            self.policy, self.name = policy, policy.name

        def decide(self, request, prefill, decode, model):
            for pool in (prefill, decode):
                views = list(pool)
                assert pool.load_keys == [load_key(view) for view in views]
                assert pool.cached_blocks == [view.cached_blocks for view in views]
            checked.append(request.request_id)
            return self.policy.decide(request, prefill, decode, model)

    module = importlib.import_module("simulator.simulate")  # the package exports a function of that name
    real = module.make_policy
    monkeypatch.setattr(module, "make_policy", lambda *args: Checking(real(*args)))
    patient = replace(SMALL, admission=AdmissionSettings(wait_seconds=120.0))
    checking = simulate(trace, "cache_aware", num_prefill=10, num_decode=10, settings=patient)
    monkeypatch.setattr(module, "make_policy", real)
    plain = simulate(trace, "cache_aware", num_prefill=10, num_decode=10, settings=patient)
    assert len(checked) >= trace.kept and any(r.cached_tokens for r in plain.records)
    assert checking.records == plain.records  # building every view changes no decision
