"""The completion service builds a worker's view only when a policy reads it, and a policy
decides as it would over every view built."""

from __future__ import annotations

import copy
import random
import time

import pytest

from foundation import wire
from foundation.kv_events import StoredBlockRecord
from orchestrator.decisions import DecisionLog
from orchestrator.fleet import Fleet
from orchestrator.index import PrefixIndex
from orchestrator.load_ledger import LoadLedger
from orchestrator.planner.calibration import Calibration
from orchestrator.planner.candidates import load_key
from orchestrator.planner.policies import POLICIES, make_policy
from orchestrator.planner.views import RequestView
from orchestrator.registry import WorkerRegistry
from orchestrator.service import CompletionService, Job

BS = 16
SALT = "tenant-a"
PREFIXES = [[10_000 * (n + 1) + i for i in range(20 * BS)] for n in range(12)]


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch):
    """Views date queued prompts by the clock: a decision and its replay must see one time."""
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now)


class MemoryFleet:
    """What the service reads of a fleet: registered workers, the ledger, in-flight counts."""

    def __init__(self):
        self.registry, self.ledger, self.counts = WorkerRegistry("m", heartbeat_timeout=3600.0), LoadLedger(), {}

    def live(self, role: str):
        return self.registry.live(role)

    pool = Fleet.pool  # the planner's pools, from ``live``, as the real fleet forms them

    def in_flight(self, worker_id: str) -> int:
        return self.counts.get(worker_id, 0)


def snapshot(worker_id: str, tokens: list[int], blocks: int) -> list[StoredBlockRecord]:
    records, parent = [], None
    for n in range(blocks):
        engine_hash = f"{worker_id}/{tokens[0]}/{n}".encode()
        records.append(StoredBlockRecord(engine_hash, parent, tuple(tokens[n * BS:(n + 1) * BS]),
                                         (SALT,) if parent is None else None))
        parent = engine_hash
    return records


def busy_service(seed: int, size: int) -> CompletionService:
    """``size`` prefill and decode workers with random heartbeats, cached prefixes, and this
    orchestrator's own traffic in the ledger (dispatched, prefilled, reserved, released)."""
    rng, fleet, index, now = random.Random(seed), MemoryFleet(), PrefixIndex(), time.monotonic()
    for role in wire.ROLES:
        for i in range(size):
            worker_id = f"{role}-{i}"
            queued = {f"{worker_id}-q{n}": rng.randint(1, 900) for n in range(rng.choice([0, 0, 1, 3]))}
            load = wire.WorkerLoad(num_running=rng.randint(0, 5), num_waiting=len(queued),
                                   num_queued_prefill_tokens=sum(queued.values()), num_free_blocks=rng.randint(0, 500),
                                   num_total_blocks=500, block_size=BS, bytes_per_block=BS * 1024,
                                   queued_prefill=queued if rng.random() < 0.7 else None,
                                   prompt_step_cap=rng.choice([0, 256]), head_prompt_age=rng.random())
            beat = wire.Heartbeat(worker_id=worker_id, role=role, incarnation="1", rpc_address="tcp://x:1",
                                  load=load, sent_at=now, model_fingerprint="m")
            assert fleet.registry.observe(beat, now).accepted
            held = [record for prefix in rng.sample(PREFIXES, 2)
                    for record in snapshot(worker_id, prefix, rng.randint(1, 20))]
            index.load_snapshot(worker_id, "1", held)
            fleet.counts[worker_id] = rng.choice([0, 0, rng.randint(1, 9)])
            for n in range(rng.choice([0, 0, 0, 1, 2])):
                request_id = f"{worker_id}-own{n}"
                fleet.ledger.dispatched(worker_id, request_id, rng.randint(1, 900), now - 1.0)
                if rng.random() < 0.5:
                    fleet.ledger.prefilled(worker_id, request_id, now - 0.5)
            if rng.random() < 0.3:
                fleet.ledger.heartbeat(worker_id)  # what was finished is in the heartbeat now: current again
            if role == "decode" and rng.random() < 0.3:
                fleet.ledger.reserved(worker_id, f"{worker_id}-res", 40)
                fleet.ledger.heartbeat(worker_id)
                fleet.ledger.released(worker_id, f"{worker_id}-res")
    policies = {name: make_policy(name) for name in POLICIES}
    return CompletionService(fleet, None, policies, "cache_aware", None, index, DecisionLog(), Calibration(),
                             None, worker_timeout=60.0)


def job_for(rng: random.Random) -> Job:
    prompt = rng.choice(PREFIXES)[:rng.randint(4, 20) * BS] + [rng.randrange(5000) for _ in range(40)]
    return Job(prompt_token_ids=prompt, sampling=wire.SamplingSpec(max_tokens=16), cache_salt=SALT)


@pytest.mark.parametrize("seed", range(6))
def test_every_worker_is_keyed_as_its_view_would_key_it(seed):
    service, rng = busy_service(seed, 40), random.Random(seed)
    job = job_for(rng)
    hashes = job.block_hashes(BS)
    matches = service.index.match(hashes)
    for role in wire.POOLS:
        pool = service.worker_views(role, hashes, matches, excluded=set())
        keys, cached = list(pool.load_keys), list(pool.cached_blocks)
        views = list(pool)
        assert keys == [load_key(view) for view in views]
        assert cached == [view.cached_blocks for view in views]
        assert any(c > 0 for c in cached)
    # some workers were keyed from their heartbeat alone, some needed the ledger
    assert 0 < sum(not service.fleet.ledger.heartbeat_is_current(f"prefill-{i}") for i in range(40)) < 40


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_policy_decides_as_it_would_over_every_view_built(policy):
    service, rng = busy_service(11, 300), random.Random(11)
    for _ in range(15):
        job = job_for(rng)
        job.policy = policy
        twin = copy.deepcopy(service.policies[policy])  # round_robin's turn, as plan() will find it
        decision, _ = service.plan(job)
        hashes = job.block_hashes(BS)
        matches = service.index.match(hashes)
        prefill, decode = (list(service.worker_views(role, hashes, matches, set())) for role in wire.POOLS)
        eager = twin.decide(service_request(job), prefill, decode,
                            service.calibration.calibrated_model(time.monotonic()))
        assert decision.chosen == eager.chosen and decision.alternatives == eager.alternatives


def service_request(job: Job) -> RequestView:
    return RequestView(job.request_id, len(job.prompt_token_ids), job.sampling.max_tokens, BS)


def test_the_cache_aware_policy_builds_the_views_of_its_candidates_only():
    service, rng = busy_service(5, 300), random.Random(5)
    job = job_for(rng)
    hashes = job.block_hashes(BS)
    matches = service.index.match(hashes)
    pools = [service.worker_views(role, hashes, matches, set()) for role in wire.POOLS]
    prebuilt = sum(pool.num_built for pool in pools)  # those the ledger had to key
    decision = service.policies["cache_aware"].decide(service_request(job), *pools,
                                                      service.calibration.calibrated_model(time.monotonic()))
    assert decision.chosen is not None
    read = sum(pool.num_built for pool in pools) - prebuilt
    assert 0 < read < (600 - prebuilt) / 4, (prebuilt, read)
