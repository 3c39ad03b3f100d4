"""Benchmark a placement decision as the orchestrator makes it, from 8 to 1,000 workers.

``CompletionService.plan`` is timed on a fleet that exists only in memory: workers are
registered in the real ``WorkerRegistry`` with heartbeat loads, the real ``PrefixIndex``
holds their cached prefixes (loaded from snapshots, as after a resync), and the real
``LoadLedger`` knows what this orchestrator dispatched. No sockets and no engines: what is
measured is the orchestrator's own work per request, which is what bounds how many
requests one orchestrator can place per second.

The fleet: ``--sizes`` prefill + decode workers per pool (default 4, 32, 500: 8, 64 and
1,000 workers). Three repositories per prefill worker, each a prefix of
``--prefix-tokens`` (1,200) held by 1-3 prefill workers and at most one decode worker;
every worker reports a random load (0-6 requests, 0-2,000 queued prompt tokens, 40-100%
of 4,096 blocks free). Each request is a repository's prefix plus a 40-token question.

Per policy and size: the median and p99 of ``plan`` (hashing the prompt, matching it in
the index, the workers' views, the policy's decision, its record) as the service makes it,
building a view only when the policy reads it, and, alternating with it on the same
requests, as it was made before, building every worker's view (``EagerViewsService``);
the ratio of the medians; and how many views the policy read. Decisions are independent
(nothing is dispatched), so every request sees the same fleet.

Usage::

    kvroute bench planner [--sizes 4,32,500] [--requests 300] [--output DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from foundation import wire
from foundation.kv_events import StoredBlockRecord
from kvroute.bench.command import Command
from kvroute.bench.progress import track
from orchestrator.decisions import DecisionLog
from orchestrator.fleet import Fleet
from orchestrator.index import PrefixIndex
from orchestrator.load_ledger import LoadLedger
from orchestrator.planner.calibration import Calibration
from orchestrator.planner.policies import POLICIES, make_policy
from orchestrator.planner.views import RequestView
from orchestrator.registry import WorkerRegistry
from orchestrator.service import CompletionService, Job
from simulator.records import percentile

BLOCK_SIZE = 16
TOTAL_BLOCKS = 4096
SALT = "bench-namespace"


class InMemoryFleet:
    """What the completion service reads of a fleet: live workers, the ledger, in-flight counts."""

    def __init__(self, registry: WorkerRegistry):
        self.registry, self.ledger = registry, LoadLedger()

    def live(self, role: str):
        return self.registry.live(role)

    pool = Fleet.pool  # the planner's pools, from ``live``, as the real fleet forms them

    def in_flight(self, worker_id: str) -> int:
        return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="4,32,500", help="workers per pool, comma-separated (default: 4,32,500)")
    parser.add_argument("--requests", type=int, default=300, help="timed decisions per policy and size (default: 300)")
    parser.add_argument("--prefix-tokens", type=int, default=1200, help="tokens of a repository prefix (default: 1200)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="policies to time (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("results/bench_planner"),
                        help="directory for results.json (default: results/bench_planner)")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.sizes = [int(size) for size in args.sizes.split(",")]
    args.policies = args.policies.split(",")
    unknown = [name for name in args.policies if name not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    if min(args.sizes) < 1 or args.requests < 1:
        parser.error("--sizes and --requests must be positive")


def snapshot(worker_id: str, tokens: list[int]) -> list[StoredBlockRecord]:
    """A worker's resident blocks for one prefix, as a snapshot lists them."""
    records, parent = [], None
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        engine_hash = f"{worker_id}/{tokens[0]}/{start}".encode()
        records.append(StoredBlockRecord(engine_hash, parent, tuple(tokens[start:start + BLOCK_SIZE]),
                                         (SALT,) if parent is None else None))
        parent = engine_hash
    return records


def build_fleet(size: int, prefix_tokens: int, rng: random.Random) -> tuple[CompletionService, list[list[int]]]:
    registry = WorkerRegistry("bench", heartbeat_timeout=3600.0)
    index = PrefixIndex()
    prefixes = [[1_000_000 * (number + 1) + position for position in range(prefix_tokens)]
                for number in range(3 * size)]
    held: dict[str, list[StoredBlockRecord]] = {}
    for prefix in prefixes:
        holders = [f"prefill-{i}" for i in rng.sample(range(size), min(size, rng.randint(1, 3)))]
        if rng.random() < 0.5:
            holders.append(f"decode-{rng.randrange(size)}")
        for worker_id in holders:
            held.setdefault(worker_id, []).extend(snapshot(worker_id, prefix))
    now = time.monotonic()
    for role in wire.POOLS:
        for i in range(size):
            worker_id = f"{role}-{i}"
            load = wire.WorkerLoad(num_running=rng.randint(0, 6), num_waiting=rng.randint(0, 2),
                                   num_queued_prefill_tokens=rng.randint(0, 2000),
                                   num_free_blocks=rng.randint(TOTAL_BLOCKS * 4 // 10, TOTAL_BLOCKS),
                                   num_total_blocks=TOTAL_BLOCKS, block_size=BLOCK_SIZE,
                                   bytes_per_block=BLOCK_SIZE * 46_080)
            beat = wire.Heartbeat(worker_id=worker_id, role=role, incarnation=f"{worker_id}-1",
                                  rpc_address=f"tcp://127.0.0.1:{10_000 + i}", load=load, sent_at=now,
                                  model_fingerprint="bench")
            verdict = registry.observe(beat, now)
            assert verdict.accepted, verdict.reason
            index.load_snapshot(worker_id, beat.incarnation, held.get(worker_id, []))
    policies = {name: make_policy(name) for name in POLICIES}
    service = CompletionService(InMemoryFleet(registry), None, policies, "cache_aware", None, index,
                                DecisionLog(), Calibration(), None, worker_timeout=60.0)
    return service, prefixes


class EagerViewsService(CompletionService):
    """The service as it was before views were built on demand: every worker's view, every decision."""

    def worker_views(self, role, block_hashes, matches, excluded):
        return list(super().worker_views(role, block_hashes, matches, excluded))


def time_policy(service: CompletionService, jobs: list[Job], policy: str) -> dict:
    """``plan`` per job, alternating the on-demand and the eager service, so both see the same load."""
    eager = EagerViewsService(service.fleet, None, service.policies, policy, None, service.index,
                              DecisionLog(), service.calibration, None, worker_timeout=60.0)
    times: dict[str, list[float]] = {"on_demand": [], "eager": []}
    views_built = []
    for job in jobs:
        job.policy = policy
        for name, planner in (("on_demand", service), ("eager", eager)):
            started = time.perf_counter()
            decision, _ = planner.plan(job)
            times[name].append(time.perf_counter() - started)
            assert decision.chosen is not None, decision.reason
        views_built.append(views_read(service, job))
    # P99: the sample of rank int(0.99 n), 0-based ("higher": the nearest rank at or above it).
    result = {name: {"p50_ms": 1e3 * statistics.median(samples),
                     "p99_ms": 1e3 * percentile(samples, 99, method="higher")}
              for name, samples in times.items()}
    result["eager_over_on_demand_p50"] = result["eager"]["p50_ms"] / result["on_demand"]["p50_ms"]
    result["views_built_per_decision"] = statistics.mean(views_built)
    return result


def views_read(service: CompletionService, job: Job) -> int:
    """How many views the policy built deciding ``job`` (both pools)."""
    hashes = job.block_hashes(BLOCK_SIZE)
    matches = service.index.match(hashes)
    pools = [service.worker_views(role, hashes, matches, set()) for role in wire.POOLS]
    request = RequestView(job.request_id, len(job.prompt_token_ids), job.sampling.max_tokens, BLOCK_SIZE)
    service.policies[job.policy].decide(request, *pools, service.calibration.calibrated_model(time.monotonic()))
    return sum(pool.num_built for pool in pools)


def run(args: argparse.Namespace) -> int:
    console = Console(width=140)
    rng = random.Random(args.seed)
    results = {"sizes": {}, "requests": args.requests, "prefix_tokens": args.prefix_tokens,
               "python": platform.python_version(), "machine": platform.machine()}
    table = Table(title="placement decision: CompletionService.plan, views on demand against every view built")
    for column in ("workers", "policy", "on demand p50 (ms)", "p99", "eager p50 (ms)", "p99",
                   "eager / on demand", "views built"):
        table.add_column(column, justify="right")
    for size in track(args.sizes, "fleet sizes", console, name=lambda size: f"{2 * size} workers", redraw=False):
        service, prefixes = build_fleet(size, args.prefix_tokens, rng)
        jobs = [Job(prompt_token_ids=rng.choice(prefixes) + [rng.randrange(50_000) for _ in range(40)],
                    sampling=wire.SamplingSpec(max_tokens=16), cache_salt=SALT, request_id=f"r{n}")
                for n in range(args.requests)]
        per_policy = results["sizes"][str(2 * size)] = {}
        for policy in track(args.policies, "policies", console, redraw=False):
            timing = per_policy[policy] = time_policy(service, jobs, policy)
            table.add_row(str(2 * size), policy, *(f"{timing[mode][q]:.2f}" for mode in ("on_demand", "eager")
                                                   for q in ("p50_ms", "p99_ms")),
                          f"{timing['eager_over_on_demand_p50']:.2f}x", f"{timing['views_built_per_decision']:.0f}")
    console.print(table)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "results.json").write_text(json.dumps(results, indent=2))
    return 0


COMMAND = Command("planner", "a placement decision as the orchestrator makes it, from 8 to 1,000 workers", __doc__,
                  add_arguments, run, check)
parse_args, main = COMMAND.parse_args, COMMAND.main
