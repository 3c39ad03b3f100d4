"""The node KV tier in the simulator: the store per node, an engine's loads and write-
throughs, the views the planner gets, and what a tier changes in a simulated run."""

from __future__ import annotations

import random

import pytest

from foundation import identity
from orchestrator.planner.policies import make_policy
from orchestrator.planner.views import PlanKind, RequestView
from orchestrator.tier_holdings import TierHoldings, TierRun
from simulator import EngineConfig, SimCalibration, SimulationSettings, TierSettings, simulate
from simulator.engine import Engine
from simulator.fleet import SimFleet
from simulator.node_store import NodeStore, node_names
from simulator.requests import TokenRequest
from simulator.sequence import RequestState
from tests.unit.sim_requests import BLOCK, engine_request, tokens
from tests.unit.test_simulator import run_engine
from transfer.node_store.index import Tier, TierIndex

ENGINE = EngineConfig(num_blocks=64, block_size=BLOCK)  # 1,024 tokens: one 640-token prompt and a little more
CALIBRATION = SimCalibration()
BLOCK_BYTES = CALIBRATION.bytes_per_token * BLOCK


def blocks_of(token_ids: list[int]) -> list[int]:
    return identity.block_hashes(token_ids, BLOCK, None)


def store_with(host: int, disk: int = 0) -> NodeStore:
    return NodeStore("node-0", TierSettings(host_blocks=host, disk_blocks=disk))


# ---------------------------------------------------------------- the store


def test_the_host_tier_demotes_its_least_recently_used_blocks_to_disk_and_a_load_brings_them_back():
    store = store_with(host=4, disk=4)
    first, second = blocks_of(tokens(1, 4 * BLOCK)), blocks_of(tokens(2, 2 * BLOCK))
    assert store.write(first) == 4
    assert store.held_run(first, 1, 4) == TierRun(host_blocks=3)
    assert store.write(second) == 2  # the two oldest of ``first`` go to disk
    assert store.held_run(first, 0, 2) == TierRun(disk_blocks=2)
    assert store.held_run(first, 0, 4) == TierRun(host_blocks=2, disk_blocks=2)  # a run spans both tiers
    store.load(first, 0, 2)  # read back into host memory, where the rest of ``first`` is now the oldest
    assert store.held_run(first, 0, 2) == TierRun(host_blocks=2)
    assert store.held_run(first, 2, 4) == TierRun(disk_blocks=2)
    assert store.held_run(second, 0, 2) == TierRun(host_blocks=2)
    assert store.num_loaded == 2


def test_without_a_disk_tier_the_oldest_blocks_are_dropped():
    store = store_with(host=4)
    first = blocks_of(tokens(1, 4 * BLOCK))
    store.write(first)
    store.write(blocks_of(tokens(2, BLOCK)))
    assert store.held_run(first, 0, 4) == TierRun()
    assert store.held_run(first, 1, 4) == TierRun(host_blocks=3)


def test_a_write_through_stores_each_block_once_and_the_holdings_follow_the_store():
    store, holdings, key = store_with(host=8, disk=8), TierHoldings(), ("node-0", "")
    prompt = blocks_of(tokens(1, 6 * BLOCK))
    assert (store.write(prompt[:4]), store.write(prompt)) == (4, 2)
    first = store.take_events()
    assert store.num_written == 6 and len(first.events) == 6  # no event for a block held already
    holdings.apply(key, first)
    store.write(blocks_of(tokens(2, 4 * BLOCK)))  # two of ``prompt`` to disk
    holdings.apply(key, store.take_events())
    assert holdings.run(key, prompt, 0) == store.held_run(prompt, 0, len(prompt)) == TierRun(4, 2)
    assert store.take_events().events == []  # each event handed over once


@pytest.mark.parametrize("disk", [0, 1, 3])
def test_the_store_moves_blocks_as_kvroutes_node_store_index_does(disk):
    """Random write-throughs and loads on the simulated store and on ``TierIndex``, driven as
    the store process drives it (a read pins its host blocks, then brings each disk block
    back and pins it; pins last until the next call): the same blocks in the same tiers,
    and the same events, after every call. A disk block that the read's own promotions
    pushed off a small disk tier is skipped (the store process would refuse the read)."""
    ours, theirs = store_with(host=5, disk=disk), TierIndex(5, disk)
    blocks = [block for label in range(4) for block in blocks_of(tokens(label, 4 * BLOCK))]
    chooser = random.Random(disk)
    for now in range(300):
        start = chooser.randrange(len(blocks))
        wanted = blocks[start:start + chooser.randint(1, 4)]
        keys = [block.to_bytes(16, "little") for block in wanted]
        if chooser.random() < 0.5:
            ours.write(wanted)
            for key in theirs.lacking(keys):
                theirs.admit(key, now)
        else:
            held = ours.held_run(wanted, 0, len(wanted)).blocks
            assert held == theirs.leading(keys)
            ours.load(wanted, 0, held)
            theirs.pin([key for key in keys[:held] if theirs.entry(key).tier is Tier.HOST], now + 0.5)
            for key in keys[:held]:
                if (entry := theirs.entry(key)) is not None and entry.tier is Tier.DISK:
                    theirs.promote(key, now)
                    theirs.pin([key], now + 0.5)
        for block, key in zip(blocks, (block.to_bytes(16, "little") for block in blocks)):
            entry = theirs.entry(key)
            assert ours.tier_of(block) == (entry and entry.tier.value)
    seen = [(event.stored, event.tier, event.key) for event in ours.take_events().events]
    assert seen == [(e.kind == "stored", e.tier.value, e.key) for e in theirs.events.since(theirs.events.epoch, 0)]


def test_workers_are_grouped_into_nodes_in_order():
    ids = ["prefill-0", "prefill-1", "prefill-2", "decode-0", "decode-1"]
    assert node_names(ids, 2) == {"prefill-0": "node-0", "prefill-1": "node-0", "prefill-2": "node-1",
                                  "decode-0": "node-1", "decode-1": "node-2"}
    assert set(node_names(ids, 0).values()) == {"node-0"}
    with pytest.raises(ValueError, match="host tier"):
        TierSettings(disk_blocks=10)


# ---------------------------------------------------------------- an engine with a store


def test_an_engine_loads_the_stores_run_past_its_own_hit_then_computes_the_rest():
    store = store_with(host=64)
    engine = Engine(ENGINE, store)
    prompt = tokens(1, 10 * BLOCK + 4)
    keys = blocks_of(prompt)
    engine.submit(engine_request("warm", prompt[:3 * BLOCK]))  # the engine's own cache: 3 blocks
    run_engine(engine)
    store.write(keys)  # the store: all 10 full blocks
    request = engine_request("hit", prompt)
    engine.submit(request)
    step = engine.schedule()
    assert step.loads == [(request, TierRun(host_blocks=7))] and not step.work
    assert request.state is RequestState.LOADING
    engine.tier_loaded(request, 7)
    assert engine.pool.cached_prefix(keys, 10) == 10  # the loaded blocks joined the prefix cache
    step = engine.schedule()
    assert [(r.request_id, new) for r, new in step.work] == [("hit", 4)]
    assert step.prefill_chunks() == [(4, 10 * BLOCK)]
    run_engine(engine)
    assert (request.cached_tokens, request.tier_tokens) == (3 * BLOCK, 7 * BLOCK)
    assert [len(blocks) for blocks in engine.take_saves()] == [3]  # "warm"'s; "hit" computed no full block


def test_an_engine_never_loads_the_last_prompt_tokens_block():
    store = store_with(host=64)
    engine = Engine(ENGINE, store)
    prompt = tokens(1, 6 * BLOCK)  # exactly 6 blocks: the 6th holds the last token, computed
    store.write(blocks_of(prompt))
    engine.submit(engine_request("hit", prompt))
    assert [run for _, run in engine.schedule().loads] == [TierRun(host_blocks=5)]


def test_a_request_writes_through_only_the_full_blocks_it_computed_itself():
    store = store_with(host=64)
    engine = Engine(ENGINE, store)
    shared = tokens(1, 4 * BLOCK)
    engine.submit(engine_request("first", shared + tokens(2, 2 * BLOCK + 5)))
    run_engine(engine)
    first_saved = engine.take_saves()
    second = shared + tokens(3, 3 * BLOCK + 5)
    engine.submit(engine_request("second", second))  # hits the 4 shared blocks
    run_engine(engine)
    [second_saved] = engine.take_saves()
    assert [len(blocks) for blocks in first_saved] == [6]
    assert second_saved == blocks_of(second)[4:7]  # not its hit, nor its partial last block
    assert engine.take_saves() == []


def test_a_pulling_consumer_does_not_look_in_its_store_and_writes_nothing_through():
    store = store_with(host=64)
    engine = Engine(ENGINE, store)
    prompt = tokens(1, 8 * BLOCK)
    store.write(blocks_of(prompt))
    pulled = engine_request("pulled", prompt, max_tokens=3, num_output=1, remote=True)
    engine.submit(pulled)
    step = engine.schedule()
    assert step.pulls and not step.loads
    engine.pull_failed(pulled)  # recomputed here: still not from the store
    step = engine.schedule()
    assert not step.loads and [(r.request_id, new) for r, new in step.work] == [("pulled", 8 * BLOCK + 1)]
    run_engine(engine)
    assert pulled.tier_tokens == 0 and engine.take_saves() == []


# ---------------------------------------------------------------- the planner's views


def test_the_planner_sends_a_prompt_to_the_worker_whose_node_store_holds_it():
    fleet = SimFleet({"prefill": 2, "decode": 1}, {"prefill": ENGINE, "decode": ENGINE}, CALIBRATION.bytes_per_token,
                     tier=TierSettings(host_blocks=256, workers_per_node=1))
    prompt = tokens(1, 30 * BLOCK)
    keys = blocks_of(prompt)
    store = fleet.workers["prefill-1"].store
    store.write(keys)
    fleet.publish_store(store)
    prefill, decode = fleet.views("prefill", keys, {}, 0.0), fleet.views("decode", keys, {}, 0.0)
    assert [(v.tier_host_blocks, v.cached_blocks) for v in prefill] == [(0, 0), (30, 0)]
    request = RequestView("r", len(prompt), 4, BLOCK)
    decision = make_policy("cache_aware").decide(request, prefill, decode, CALIBRATION.cost_model())
    assert decision.chosen.kind is PlanKind.DISAGG and decision.chosen.prefill_worker == "prefill-1"
    assert decision.chosen.estimate.tier_tokens == 29 * BLOCK  # short of the last token's block


# ---------------------------------------------------------------- simulated runs


def evicted_and_back() -> list[TokenRequest]:
    """Prompt A, then four others that push A out of both engines (and, with a small host
    tier, out of host memory to disk), then A again on an idle cluster."""
    prompt = tokens(1, 40 * BLOCK)
    fillers = [TokenRequest(i, 2.0 * i, 1, tokens(10 + i, 60 * BLOCK)) for i in range(1, 5)]
    return [TokenRequest(0, 0.0, 1, prompt), *fillers, TokenRequest(5, 20.0, 1, prompt)]


def run_with(tier: TierSettings):
    settings = SimulationSettings(prefill_engine=ENGINE, decode_engine=ENGINE, tier=tier)
    return simulate(evicted_and_back(), "cache_aware", 1, 1, CALIBRATION, 0, settings)


@pytest.mark.parametrize("tier, host, disk", [(TierSettings(host_blocks=1000), 39, 0),
                                              (TierSettings(host_blocks=100, disk_blocks=1000), 0, 39)])
def test_a_prompt_evicted_from_every_engine_comes_back_from_the_tier(tier, host, disk):
    without, with_tier = run_with(TierSettings()), run_with(tier)
    again, cold = with_tier.records[-1], without.records[-1]
    assert cold.cached_tokens == 0  # A had left both engines
    assert (again.cached_tokens, again.tier_tokens, again.tier_disk_tokens) == (39 * BLOCK, 39 * BLOCK, disk * BLOCK)
    load = CALIBRATION.tier_load_seconds(host, disk, BLOCK_BYTES)
    assert again.tier_load_seconds == pytest.approx(load)
    rest = CALIBRATION.step_seconds([(BLOCK, 39 * BLOCK)], 0)
    assert again.ttft_seconds == pytest.approx(load + rest)  # the load, then one step for the last block
    assert cold.ttft_seconds == pytest.approx(CALIBRATION.step_seconds([(40 * BLOCK, 0)], 0))
    assert again.ttft_seconds < cold.ttft_seconds
    # A perfectly calibrated planner foresaw the load and its time.
    assert again.predicted_tier_tokens == again.tier_tokens
    assert again.estimated_ttft_seconds == pytest.approx(again.ttft_seconds)
    assert with_tier.summary.tier_tokens == sum(r.tier_tokens for r in with_tier.records) == 39 * BLOCK


def test_a_tier_no_request_can_use_changes_nothing():
    """Every prompt distinct: the store fills through write-throughs, but nothing is loaded,
    and the run is the one without a tier, request by request."""
    requests = [TokenRequest(i, 0.3 * i, 8, tokens(i, (20 + 7 * i % 30) * BLOCK + i)) for i in range(30)]
    runs = [simulate(requests, "cache_aware", 2, 2, CALIBRATION, 0,
                     SimulationSettings(prefill_engine=ENGINE, decode_engine=ENGINE, tier=tier))
            for tier in (TierSettings(), TierSettings(host_blocks=50, disk_blocks=50, workers_per_node=3))]
    assert runs[0].records == runs[1].records
    assert runs[1].summary.tier_tokens == 0
    assert [(s.node, s.loaded_blocks) for s in runs[1].stores] == [("node-0", 0), ("node-1", 0)]
    assert all(s.written_blocks and s.disk_blocks for s in runs[1].stores)  # full, and spilling to disk
