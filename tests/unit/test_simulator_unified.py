"""Unified engines in the simulator: in both planner pools, a prefill stalling the decodes
running beside it, PULL plans between replicas, and the peers' router model."""

from __future__ import annotations

from collections import defaultdict

import pytest

from orchestrator.planner.settings import PlannerSettings
from simulator import EngineConfig, SimCalibration, simulate
from simulator.fleet import SimFleet, check_counts
from simulator.peers import PrefixHashRouter, one_engine_machine, replica_of
from simulator.records import FINISHED
from simulator.requests import TokenRequest
from tests.unit.sim_requests import tokens
from workloads import generate_named

ENGINES = {role: EngineConfig() for role in ("prefill", "decode", "unified")}


def test_a_unified_worker_is_in_both_pools_and_a_touch_reaches_both():
    fleet = SimFleet({"prefill": 1, "decode": 1, "unified": 2}, ENGINES, 100)
    assert [w.worker_id for w in fleet.pools["prefill"]] == ["prefill-0", "unified-0", "unified-1"]
    assert [w.worker_id for w in fleet.pools["decode"]] == ["decode-0", "unified-0", "unified-1"]
    for changed in fleet._changed.values():
        changed.clear()
    fleet.workers["unified-1"].touch()
    assert fleet._changed == {"prefill": {2}, "decode": {2}}


@pytest.mark.parametrize("counts", [{"prefill": 1}, {"decode": 2}, {"prefill": 0, "decode": 0, "unified": 0},
                                    {"unified": -1, "prefill": 1, "decode": 1}])
def test_a_fleet_that_cannot_serve_is_refused(counts):
    with pytest.raises(ValueError):
        check_counts(counts)


def test_a_prefill_on_a_unified_engine_stalls_the_decode_running_beside_it():
    calibration = SimCalibration()
    decoding = TokenRequest(0, 0.0, 200, tokens(0, 64))
    alone = simulate([decoding], "cache_aware", 0, 0, calibration, num_unified=1).records[0]
    prompt = TokenRequest(1, 1.0, 1, tokens(1, 512))  # arrives while the first decodes; one token out
    both = {r.index: r for r in simulate([decoding, prompt], "cache_aware", 0, 0, calibration,
                                         num_unified=1).records}
    assert both[1].plan == "local" and both[1].decode_worker == "unified-0"
    # Exactly one of the decoding request's steps also computed the 512-token prompt.
    stall = calibration.step_seconds([(512, 0)], 1) - calibration.step_seconds([], 1)
    assert both[0].e2e_seconds - alone.e2e_seconds == pytest.approx(stall, rel=1e-9)
    assert stall > 0.1  # the prompt, not the decode, sets that step's length


def test_pull_plans_move_a_cached_prefix_between_replicas_and_leave_nothing_behind():
    options = {"num_prefixes": 4, "prefix_tokens": 512, "suffix_tokens": 64, "output_tokens": 256,
               "repetitions_per_prefix": 25}
    requests = generate_named("prefix-repetition", options, requests=100, rate=4.0, seed=0)
    result = simulate(requests, "cache_aware", 0, 0, num_unified=8)  # the loop checks nothing is left
    assert all(r.status == FINISHED for r in result.records)
    pulls = [r for r in result.records if r.plan == "pull"]
    assert pulls, "the planner lent a prefix to a cold replica at least once"
    assert all(r.cached_tokens >= 512 for r in pulls)  # the lent prefix, hit on the sink
    # Blocks the sink already holds when the lend lands (another request brought them) do not move.
    assert any(r.transfer_bytes > 0 for r in pulls)


def test_the_prefix_hash_router_places_by_the_prompts_head_alone():
    heads = [tokens(label, 128) for label in range(3)]
    requests = [TokenRequest(i, i * 0.01, 32, heads[i % 3] + tokens(100 + i, 40)) for i in range(30)]
    result = simulate(requests, PrefixHashRouter(PlannerSettings()), 0, 0, num_unified=4)
    replicas = defaultdict(set)
    for record in result.records:
        replicas[record.index % 3].add(record.decode_worker)
    assert all(len(workers) == 1 for workers in replicas.values())  # however loaded that replica got
    again = simulate(requests, PrefixHashRouter(PlannerSettings()), 0, 0, num_unified=4)
    assert [r.decode_worker for r in again.records] == [r.decode_worker for r in result.records]
    assert replica_of(["a", "b"], 7) == replica_of(["a", "b"], 7) and 0 <= replica_of(["b"], 7) < 7


def test_one_engine_on_the_machine_scales_its_compute_and_its_memory():
    calibration, engine = one_engine_machine(SimCalibration(), EngineConfig(num_blocks=100), 4)
    base = SimCalibration()
    assert engine.num_blocks == 400
    assert calibration.decode_per_sequence_seconds == base.decode_per_sequence_seconds / 4
    assert calibration.prefill_fixed_seconds == base.prefill_fixed_seconds  # a step still synchronises once
