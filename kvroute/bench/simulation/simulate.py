"""Simulate placement policies side by side on a trace or workload, with the reuse bounds.

Each policy replays the same requests on a fresh simulated cluster (``simulator``: vLLM-
like engines, the production planner and index). Printed: a table per policy (TTFT and
E2E P50/P99, queue P50, hit rate, plans, simulated and wall seconds) and the reuse
oracle of the same requests (``kvroute.bench.oracle``): the unlimited-cache bound and
one shared LRU cache with perfect routing, at the total KV capacity of all workers and
of the prefill pool alone (in DISAGG plans only prefill workers' caches give hits); each
policy's reused tokens are shown as a share of the all-workers LRU bound.

Inputs: ``--trace FILE`` (Mooncake JSONL, default the synthetic trace in shared/data),
scaled by ``--block-tokens`` (64), ``--output-scale`` (1.0), ``--max-context-tokens``
(8,192) and ``--time-scale`` (1.0), first ``--limit`` records, of which
``--family-fraction`` keeps every record of a share of the prefix families (seeded by
``--seed``; with ``--block-tokens 32 --output-scale 0.1 --max-context-tokens 4096`` these
are the requests ``kvroute bench trace`` replays on a real cluster);
or ``--workload NAME``, a seeded generator of ``workloads`` (``--requests``,
``--rate``, and ``--workload-options KEY=VALUE,...`` for any field of its config). Cost curves:
``--calibration FILE`` (JSON of ``SimCalibration`` fields), else the documented defaults.
``--cores N``: the engines share N CPU cores, bound as ``kvroute serve`` binds them
(engine i on core i % N; ``simulator.cpu``); default 0, none shared.
``--long-prefill-tokens``: each engine's per-prompt step cap, as the workers' flag (256).
``--tier-host-blocks N`` (and ``--tier-disk-blocks M``): a node KV store on every node of
``--workers-per-node`` workers (default 8; 0: one node), with N blocks in host memory and
M on disk (``simulator.node_store``); default 0, no node stores. The hit rate then counts
the tokens loaded from them, and the "tier" column is their share of the prompt tokens.

Output: ``DIR/results.json`` (settings, oracle, per-policy summaries and, unless
``--no-records``, per-request records).

Usage::

    kvroute bench simulate [--prefill 4] [--decode 4] [--policies a,b] [--output DIR]
        [--trace FILE | --workload NAME [--workload-options K=V,...]] [--kv-blocks N] [--seed S]
        [--tier-host-blocks N [--tier-disk-blocks M] [--workers-per-node W]]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table

from foundation import identity
from kvroute.bench.command import Command
from kvroute.bench.oracle import OracleRequest, oracle_requests, reuse_bounds
from kvroute.bench.paths import DEFAULT_TRACE, REPO_ROOT
from kvroute.bench.progress import track
from orchestrator.planner.policies import POLICIES
from simulator import CpuSettings, EngineConfig, SimCalibration, SimulationSettings, TierSettings, simulate
from simulator.requests import replay_requests
from worker.settings import PREFILL_LONG_PREFILL_TOKENS
from workloads import GENERATORS, generate_named, parse_options
from workloads.trace import ScaledTrace, TraceScaling, read_trace, sample_families, scale_trace

console = Console(width=int(os.environ.get("COLUMNS", "160")))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, default=None, help=f"Mooncake JSONL (default: {DEFAULT_TRACE})")
    source.add_argument("--workload", choices=list(GENERATORS), help="a seeded workload generator")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: all)")
    parser.add_argument("--prefill", type=int, default=4, help="prefill workers (default: %(default)s)")
    parser.add_argument("--decode", type=int, default=4, help="decode workers (default: %(default)s)")
    parser.add_argument("--kv-blocks", type=int, default=EngineConfig().num_blocks, help="KV blocks per worker")
    parser.add_argument("--block-size", type=int, default=EngineConfig().block_size)
    parser.add_argument("--calibration", type=Path, help="JSON of SimCalibration fields")
    parser.add_argument("--cores", type=int, default=0,
                        help="CPU cores the engines share, engine i bound to core i %% N (default: 0, none shared)")
    parser.add_argument("--long-prefill-tokens", type=int, default=PREFILL_LONG_PREFILL_TOKENS,
                        help="most prompt tokens one request computes a step while others wait, as the "
                             "workers' flag (default: %(default)s; 0: whole steps in turn)")
    parser.add_argument("--no-evict-pulled-first", dest="evict_pulled_first", action="store_false",
                        help="decode workers keep pulled prompts in plain LRU order, as the workers' flag "
                             "(default: pulled prompts are evicted first, as kvroute's workers do)")
    add_tier_arguments(parser)
    parser.add_argument("--block-tokens", type=int, default=TraceScaling().block_tokens)
    parser.add_argument("--time-scale", type=float, default=TraceScaling().time_scale)
    parser.add_argument("--limit", type=int, help="first N trace records only")
    parser.add_argument("--family-fraction", type=float, default=1.0,
                        help="trace: every record of this share of its prefix families, seeded by --seed "
                             "(workloads.trace.sample_families; as kvroute bench trace replays it)")
    parser.add_argument("--output-scale", type=float, default=TraceScaling().output_scale)
    parser.add_argument("--max-context-tokens", type=int, default=TraceScaling().max_context_tokens)
    parser.add_argument("--requests", type=int, help="workload: requests (default: the generator's)")
    parser.add_argument("--rate", type=float, help="workload: requests/s (default: the generator's)")
    parser.add_argument("--workload-options", default="", help="workload: KEY=VALUE,... overrides of its config")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "results" / "simulate")
    parser.add_argument("--no-records", action="store_true", help="leave per-request records out of the JSON")


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tier-host-blocks", type=int, default=TierSettings().host_blocks,
                        help="node KV store: blocks in host memory per node (default: %(default)s, no stores)")
    parser.add_argument("--tier-disk-blocks", type=int, default=TierSettings().disk_blocks,
                        help="node KV store: blocks on disk per node, behind host memory (default: %(default)s)")
    parser.add_argument("--workers-per-node", type=int, default=TierSettings().workers_per_node,
                        help="workers sharing a node store, in order, prefill pool first "
                             "(default: %(default)s; 0: one node)")


def tier_settings(args: argparse.Namespace) -> TierSettings:
    return TierSettings(host_blocks=args.tier_host_blocks, disk_blocks=args.tier_disk_blocks,
                        workers_per_node=args.workers_per_node)


def load_requests(args: argparse.Namespace):
    if args.workload:
        options = parse_options([option for option in args.workload_options.split(",") if option])
        return generate_named(args.workload, options, requests=args.requests, rate=args.rate, seed=args.seed)
    scaling = TraceScaling(block_tokens=args.block_tokens, time_scale=args.time_scale, seed=args.seed,
                           output_scale=args.output_scale, max_context_tokens=args.max_context_tokens)
    records = read_trace(args.trace or DEFAULT_TRACE, args.limit)
    if args.family_fraction < 1:
        records = sample_families(records, args.family_fraction, args.seed)
    return scale_trace(records, scaling)


def oracle_of(source, block_size: int) -> list[OracleRequest]:
    if isinstance(source, ScaledTrace):  # cheap keys, no tokens needed
        return oracle_requests(source.requests, block_size)
    return [OracleRequest(r.prompt_tokens, tuple(identity.block_hashes(r.prompt_token_ids, block_size, None)))
            for r in replay_requests(source)]


def bounds(source, args: argparse.Namespace) -> dict:
    requests = oracle_of(source, args.block_size)
    every = reuse_bounds(requests, args.block_size, args.kv_blocks * (args.prefill + args.decode))
    prefill_only = reuse_bounds(requests, args.block_size, args.kv_blocks * args.prefill)
    return {"prompt_tokens": every.unlimited.prompt_tokens,
            "unlimited": {"reused_tokens": every.unlimited.reused_tokens, "hit_rate": every.unlimited.hit_rate},
            "lru_all_workers": {"capacity_blocks": every.capacity_blocks, "reused_tokens": every.lru.reused_tokens,
                                "hit_rate": every.lru.hit_rate},
            "lru_prefill_pool": {"capacity_blocks": prefill_only.capacity_blocks,
                                 "reused_tokens": prefill_only.lru.reused_tokens,
                                 "hit_rate": prefill_only.lru.hit_rate}}


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_table(results: list, oracle: dict, title: str) -> None:
    table = Table(title=title)
    for column in ("policy", "done", "429", "TTFT p50", "TTFT p99", "E2E p50", "E2E p99", "queue p50",
                   "hit rate", "tier", "of LRU", "local", "disagg", "sim s", "wall s"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    lru = oracle["lru_all_workers"]["reused_tokens"]
    for result in results:
        s = result.summary
        table.add_row(s.policy, str(s.finished), str(s.rejected), seconds(s.ttft_p50), seconds(s.ttft_p99),
                      seconds(s.e2e_p50), seconds(s.e2e_p99), seconds(s.queue_p50), f"{s.hit_rate:.1%}",
                      f"{s.tier_hit_rate:.1%}" if result.stores else "-",
                      f"{s.cached_tokens / lru:.0%}" if lru else "-", str(s.local_plans), str(s.disagg_plans),
                      f"{result.simulated_seconds:.0f}", f"{result.wall_seconds:.1f}")
    console.print(table)
    console.print(f"reuse bounds: unlimited {oracle['unlimited']['hit_rate']:.1%}; shared LRU of all workers' "
                  f"{oracle['lru_all_workers']['capacity_blocks']:,} blocks "
                  f"{oracle['lru_all_workers']['hit_rate']:.1%}; "
                  f"of the prefill pool's {oracle['lru_prefill_pool']['capacity_blocks']:,} blocks "
                  f"{oracle['lru_prefill_pool']['hit_rate']:.1%}")


def run(args: argparse.Namespace) -> int:
    source = load_requests(args)
    calibration = SimCalibration.from_json(args.calibration) if args.calibration else SimCalibration()
    engine = EngineConfig(num_blocks=args.kv_blocks, block_size=args.block_size,
                          long_prefill_tokens=args.long_prefill_tokens, evict_pulled_first=args.evict_pulled_first)
    settings = SimulationSettings(prefill_engine=engine, decode_engine=engine, cpu=CpuSettings(cores=args.cores),
                                  tier=tier_settings(args))
    oracle = bounds(source, args)
    results = []
    for policy in track(args.policies.split(","), "policies", console):
        results.append(simulate(source, policy, args.prefill, args.decode, calibration, args.seed, settings))
        console.print(f"{policy}: {results[-1].wall_seconds:.1f} s")
    name = args.workload or Path(args.trace or DEFAULT_TRACE).name
    dropped = f", {source.dropped} dropped" if isinstance(source, ScaledTrace) else ""
    print_table(results, oracle, f"{name} on {args.prefill} prefill + {args.decode} decode workers{dropped}")
    args.output.mkdir(parents=True, exist_ok=True)
    report = {"settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
              "calibration": calibration.to_dict(), "dropped": getattr(source, "dropped", 0), "oracle": oracle,
              "policies": [result.to_dict(with_records=not args.no_records) for result in results]}
    (args.output / "results.json").write_text(json.dumps(report, indent=1))
    return 0


COMMAND = Command("simulate", "placement policies side by side in the simulator, with the reuse bounds", __doc__,
                  add_arguments, run)
parse_args, main = COMMAND.parse_args, COMMAND.main
