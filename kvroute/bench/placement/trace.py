"""Compare placement policies on one cluster with a Mooncake trace.

The real-cluster counterpart of the simulator's trace replays. Like
``kvroute bench placement`` (whose cluster, warm-up, per-policy loop and report it
uses, ``kvroute.bench.placement``): ONE embedded cluster (``python -m kvroute serve``: orchestrator, 2 prefill workers,
1 decode worker, ``--allow-policy-override``); for each policy every cache is emptied and
the same requests are replayed open loop, each with ``X-KVRoute-Policy: <policy>``.

The requests are every record of a seeded ``--family-fraction`` of the trace's prefix
families (``workloads.trace.sample_families``: records with the same first hash id;
families share nothing with each other), so the sample keeps the trace's span, its
rhythm and each family's sharing. The trace's first N records would not: they are mostly
first visits (the synthetic trace's first 80 share 5% of their tokens; at the default
fraction, 0.02, the sample is ~80 requests over the trace's 17 minutes, ~0.08 per second).
Then ``workloads.trace`` scales them: every 512-token block becomes ``--block-tokens``
tokens (default 32, the workers' block size on CPU, so the trace's sharing maps onto the
engines' prefix cache block for block), outputs are multiplied by ``--output-scale``
(default 0.1: TTFT is what placement decides, and the trace's 149-token mean output would
make each run a decode benchmark), and arrival times by ``--time-scale``. Records that do
not fit the model's context after scaling are dropped (counted in the results).

Reuse bounds (``kvroute.bench.oracle``), for exactly the replayed requests in order, at the
workers' block size: **unlimited** (nothing is ever evicted) and **shared LRU** (one LRU
cache as large as all three workers' caches together, every request routed to it). Each
policy's reused tokens (``cached_tokens`` of the responses' usage, summed) are reported as a
share of both; the target is ``cache_aware`` >= 90% of the shared-LRU bound, with P50 TTFT
<= 0.8x ``round_robin`` and P99 no worse than the best baseline.

Sizing: each worker's KV cache is, by default, ``--cache-fraction`` of the replayed
requests' distinct prompt blocks plus one longest request, so that the caches, not the
trace, limit reuse.

Outputs, under ``--output`` (default ``results/measure_trace``): ``results.json`` (settings,
the workers' engine settings as ``simulator.from_replay`` reads them (``workload``),
trace summary and bounds, per-policy summaries with their shares of the bounds, per-request
rows), the plots and the cluster's log, as ``kvroute bench placement`` writes them.

Usage::

    kvroute bench trace [--trace FILE] [--family-fraction 0.02] [--time-scale 1]
        [--policies cache_aware,round_robin,...] [--output DIR] [--wait-quiet 120]
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from kvroute.bench.command import Command
from kvroute.bench.oracle import oracle_requests, reuse_bounds
from kvroute.bench.paths import DEFAULT_TRACE
from kvroute.bench.placement.cluster import (
    ALL_POLICIES,
    DECODE_WORKERS,
    MAX_MODEL_LEN,
    PREFILL_WORKERS,
    cache_gib,
    checked_policies,
    console,
    kv_cache_tokens,
    start_cluster,
)
from kvroute.bench.placement.runs import Runs, measure, report, run_record, warm_up
from kvroute.bench.replay_sources import trace_item
from worker.block_size import CPU_BLOCK_SIZE
from worker.dtype import resolve_here
from workloads import RepositoryAssistantConfig, load_tokenizer, tokenizer_counter
from workloads.trace import ScaledTrace, TraceRecord, TraceScaling, read_trace, sample_families, scale_trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=Path("results/measure_trace"),
                        help="folder for results.json, plots and the cluster's log (default: %(default)s)")
    parser.add_argument("--policies", default=",".join(ALL_POLICIES),
                        help="comma-separated policies, run in this order (default: all five)")
    parser.add_argument("--family-fraction", type=float, default=0.02,
                        help="share of the trace's prefix families replayed, all of each one's records "
                             "(default: %(default)s)")
    parser.add_argument("--warm-requests", type=int, default=0,
                        help="leading requests sent but left out of the statistics and the bounds' shares "
                             "(default: %(default)s)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="arrival seconds = timestamp / 1000 x this (default: %(default)s)")
    parser.add_argument("--block-tokens", type=int, default=CPU_BLOCK_SIZE,
                        help="tokens per 512-token trace block (default: %(default)s)")
    parser.add_argument("--output-scale", type=float, default=0.1,
                        help="factor on the trace's output lengths (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the family sample and of the blocks' token content (default: %(default)s)")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="each worker's KV cache; default: --cache-fraction of the distinct prompt blocks "
                             "plus one longest request")
    parser.add_argument("--cache-fraction", type=float, default=0.4, help="(default: %(default)s)")
    parser.add_argument("--dtype", default="auto", help="engine dtype (default: %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="orchestrator port (default: a free one)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the scaled trace, the cache size and the reuse bounds; start nothing")
    parser.add_argument("--wait-quiet", type=float, default=0.0,
                        help="wait up to this many seconds, before the cluster starts and before each policy, "
                             "for other processes to leave the CPUs alone (default: don't wait)")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.policies = checked_policies(parser, args.policies)
    if not 0 < args.family_fraction <= 1 or args.time_scale <= 0 or args.warm_requests < 0:
        parser.error("--family-fraction must be in (0, 1], --time-scale positive, --warm-requests not negative")
def scaled_sample(records: list[TraceRecord], fraction: float, scaling: TraceScaling) -> ScaledTrace:
    """The records of a ``fraction`` of the families (seeded by ``scaling.seed``), scaled."""
    sample = scale_trace(sample_families(records, fraction, scaling.seed), scaling)
    if sample.kept < 2:
        raise ValueError(f"fewer than two requests in a {fraction} sample of the trace's families fit the context")
    return sample


def trace_bounds(trace: ScaledTrace, block_size: int, capacity_blocks: int, counted_from: int) -> dict:
    """The reuse bounds of the replayed requests; the tokens of those with index >= ``counted_from``."""
    bounds = reuse_bounds(oracle_requests(trace.requests, block_size), block_size, capacity_blocks)
    counted = [k for k, request in enumerate(trace.requests) if request.index >= counted_from]

    def tokens(per_request) -> int:
        return sum(per_request[k] for k in counted)

    return {"block_size": block_size, "capacity_blocks": capacity_blocks,
            "prompt_tokens": sum(trace.requests[k].prompt_tokens for k in counted),
            "unlimited": {"reused_tokens": tokens(bounds.unlimited.per_request),
                          "hit_rate_all": bounds.unlimited.hit_rate},
            "lru_all_workers": {"reused_tokens": tokens(bounds.lru.per_request), "hit_rate_all": bounds.lru.hit_rate}}


def distinct_prompt_tokens(trace: ScaledTrace, block_size: int) -> int:
    return block_size * len({key for request in oracle_requests(trace.requests, block_size)
                             for key in request.block_keys})


def shares_of_bounds(runs: Runs, bounds: dict) -> None:
    """Each policy's reused tokens as a share of the bounds, into its summary."""
    for summary in runs.summaries.values():
        for bound in ("unlimited", "lru_all_workers"):
            whole = bounds[bound]["reused_tokens"]
            summary[f"of_{bound}"] = summary["cached_tokens"] / whole if whole else None


def run(args: argparse.Namespace) -> int:
    output: Path = args.output
    output.mkdir(parents=True, exist_ok=True)
    scaling = TraceScaling(block_tokens=args.block_tokens, output_scale=args.output_scale,
                           max_context_tokens=MAX_MODEL_LEN, time_scale=args.time_scale, seed=args.seed)
    trace = scaled_sample(read_trace(args.trace), args.family_fraction, scaling)
    block_size = CPU_BLOCK_SIZE
    dtype = resolve_here(args.dtype)
    working_set = distinct_prompt_tokens(trace, block_size)
    longest = max(request.prompt_tokens + request.max_tokens for request in trace.requests)
    kv_cache_gib = cache_gib(args.kv_cache_gib, args.cache_fraction * working_set + longest, dtype)
    per_worker_blocks = int(kv_cache_tokens(kv_cache_gib, dtype)) // block_size
    bounds = trace_bounds(trace, block_size, per_worker_blocks * (PREFILL_WORKERS + DECODE_WORKERS),
                          args.warm_requests)
    console.print(f"trace: {trace.kept} requests ({trace.dropped} dropped) over "
                  f"{trace.requests[-1].arrival_seconds:.0f} s, "
                  f"prompts {min(r.prompt_tokens for r in trace.requests)}-{longest} tokens, distinct prompt blocks "
                  f"{working_set} tokens; KV cache per worker {kv_cache_gib:.3f} GiB = {per_worker_blocks} blocks; "
                  f"reuse bounds: unlimited {bounds['unlimited']['reused_tokens']}, shared LRU "
                  f"{bounds['lru_all_workers']['reused_tokens']} of {bounds['prompt_tokens']} prompt tokens",
                  highlight=False)
    if args.dry_run:
        return 0

    cluster, waited = start_cluster(args, kv_cache_gib, dtype, output)
    tokenizer_count = tokenizer_counter(load_tokenizer())
    items = [trace_item(request) for request in trace.requests]
    runs = measure(cluster, items, args.policies, args.warm_requests, args.wait_quiet,
                   lambda running: warm_up(running, RepositoryAssistantConfig(seed=args.seed), tokenizer_count))
    shares_of_bounds(runs, bounds)
    result = run_record(args, cluster, runs, waited, kv_cache_gib, dtype)
    result["trace"] = {"path": str(args.trace), "kept": trace.kept, "dropped": trace.dropped,
                       "scaling": asdict(trace.scaling), "distinct_prompt_tokens": working_set,
                       "longest_request_tokens": longest, "kv_cache_blocks_per_worker": per_worker_blocks,
                       "bounds": bounds}
    for policy, summary in runs.summaries.items():
        console.print(f"{policy}: reused {summary['cached_tokens']} tokens = "
                      f"{(summary['of_lru_all_workers'] or 0):.1%} of the shared-LRU bound, "
                      f"{(summary['of_unlimited'] or 0):.1%} of the unlimited one", highlight=False)
    report(output, result, runs, "Placement policies, Mooncake trace")
    return 1 if runs.aborted else 0


COMMAND = Command("trace", "placement policies on a cluster it starts, a Mooncake trace", __doc__, add_arguments,
                  run, check)
parse_args, main = COMMAND.parse_args, COMMAND.main
