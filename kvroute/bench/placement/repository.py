"""Compare placement policies on one cluster with the repository-assistant workload.

One run starts ONE embedded cluster (``python -m kvroute serve``: orchestrator, 2 prefill
workers, 1 decode worker, ``--allow-policy-override``) and, for each policy in turn,

1. empties every worker's prefix cache (``POST /admin/reset-cache``) and waits until the
   index is empty too, so every policy starts cold;
2. replays the same seeded workload (``workloads``: R repositories with long
   shared prefixes, short questions, Zipf popularity, Poisson arrivals) open-loop on its
   arrival schedule: each request is a streaming chat completion sent at its arrival time
   with the header ``X-KVRoute-Policy: <policy>``, whether or not earlier ones finished;
3. measures each request on the client: TTFT (first content chunk), the gap to the second
   content chunk, mean inter-token latency, end-to-end latency; prompt and cached tokens
   come from the final usage chunk, and ``GET /v1/decisions/{id}`` gives the plan (LOCAL or
   DISAGG), the chosen workers, predicted vs actual reused tokens and the server's timings.

Sizing. Each worker's KV cache (``--kv-cache-gib``) is, by default, chosen from the
workload: ``--cache-fraction`` (0.4) of the shared-prefix working set (the templated
system turns of all repositories, 23,040 bytes a token in bf16), plus room for one
longest prompt in flight, so about half the working set while a worker is idle. A
block-level LRU simulation of the default workload (128-token blocks, tail blocks evicted
first, as vLLM does) puts round-robin's hit rate at 40-50% at that size and a policy that
keeps each repository on one prefill worker at 70-80%. The workers run at their default
block size (32 tokens on CPU, ``worker.block_size``), so a hit recomputes less of
a prefix's tail than that simulation assumed. At a third of the working set both are lower
(about 30% and 55-60%): every request also leaves one unshareable block (prefix tail +
question) in the cache, and each repository's first request misses anyway (12 of 120).
The same size is the decode worker's cache, which must hold the prompts of all requests
decoding at once (~10 blocks each): about 5-6 with the defaults.

Load. The defaults (120 requests at 0.9/s, prefixes of 700-1400 tokens, 16 output tokens)
take ~2.5 minutes per policy, ~13-15 minutes in all with start-up. Three engines share
two cores here (the decode worker shares core 0 with the first prefill worker), so keep
the rate below what they sustain; ``--wait-quiet`` waits for other people's jobs to leave
the CPUs, and the CPU cores they used during each policy are recorded
(``foreign_cpu_cores``) either way.

Outputs, under ``--output`` (default ``results/measure_placement``): ``results.json``
(settings, workload summary, per-policy summaries, per-request rows), ``ttft_cdf.png``,
``hit_rate.png``, ``worker_load.png`` and the cluster's log ``serve.log``. A table and
the ratios cache_aware/round_robin P50 TTFT and cache_aware/best-baseline P99 TTFT are
printed. The cluster is stopped with SIGINT at the end, also on errors and Ctrl-C.

Notes: the cost model of ``cache_aware`` is refit online from every request the
orchestrator serves, whatever policy placed it, so policies that run later inherit
calibration (prefill coefficients, link estimates) from earlier ones, not cache contents:
those are reset. P99 over ~120
requests is close to the second-largest sample.

Usage::

    kvroute bench placement [--output DIR] [--policies cache_aware,round_robin]
        [--requests N] [--rate R] [--repositories K] [--seed S] [--kv-cache-gib G]
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from kvroute.bench.command import Command
from kvroute.bench.placement.cluster import (
    ALL_POLICIES,
    bytes_per_token,
    cache_gib,
    checked_policies,
    console,
    kv_cache_tokens,
    start_cluster,
)
from kvroute.bench.placement.runs import measure, report, run_record, warm_up
from kvroute.bench.replay_sources import workload_item
from worker.dtype import resolve_here
from workloads import (
    RepositoryAssistantConfig,
    estimate_prefix_tokens,
    generate_workload,
    load_tokenizer,
    prompt_tokens,
    repository_prefixes,
    tokenizer_counter,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, default=Path("results/measure_placement"),
                        help="folder for results.json, plots and the cluster's log (default: %(default)s)")
    parser.add_argument("--policies", default=",".join(ALL_POLICIES),
                        help="comma-separated policies, run in this order (default: all five)")
    parser.add_argument("--requests", type=int, default=120, help="requests per policy (default: %(default)s)")
    parser.add_argument("--warm-requests", type=int, default=0,
                        help="leading requests of each policy's replay that are sent but left out of its "
                             "statistics, so they describe warm caches rather than each repository's first, "
                             "compulsory miss (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=0.9,
                        help="Poisson arrival rate, requests/s (default: %(default)s)")
    parser.add_argument("--repositories", type=int, default=12, help="repositories (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    parser.add_argument("--prefix-min-tokens", type=int, default=700, help="(default: %(default)s)")
    parser.add_argument("--prefix-max-tokens", type=int, default=1400, help="(default: %(default)s)")
    parser.add_argument("--zipf-exponent", type=float, default=0.3, help="(default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (default: %(default)s)")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="each worker's KV cache; default: --cache-fraction of the prefix working set "
                             "plus one longest prompt")
    parser.add_argument("--cache-fraction", type=float, default=0.4,
                        help="share of the prefix working set one worker's cache holds when "
                             "--kv-cache-gib is not given (default: %(default)s)")
    parser.add_argument("--dtype", default="auto",
                        help="engine dtype; auto: bfloat16 where the CPU computes it natively, else float32 "
                             "(default: %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="orchestrator port (default: a free one)")
    parser.add_argument("--wait-quiet", type=float, default=0.0,
                        help="on a shared machine: wait up to this many seconds before starting the cluster, "
                             "and again before each policy, for other processes to leave the CPUs alone "
                             "(default: don't wait); their load is recorded either way")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.policies = checked_policies(parser, args.policies)


def workload_config(args: argparse.Namespace) -> RepositoryAssistantConfig:
    return RepositoryAssistantConfig(
        repositories=args.repositories, requests=args.requests, rate=args.rate,
        prefix_min_tokens=args.prefix_min_tokens, prefix_max_tokens=args.prefix_max_tokens,
        zipf_exponent=args.zipf_exponent, max_tokens=args.max_tokens, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    output: Path = args.output
    output.mkdir(parents=True, exist_ok=True)
    config = workload_config(args)

    tokenizer = load_tokenizer()
    count = tokenizer_counter(tokenizer)
    workload = generate_workload(config, count)
    prefix_tokens = estimate_prefix_tokens(repository_prefixes(config, count), tokenizer)
    longest_prompt = max(prompt_tokens(tokenizer, r.messages) for r in workload)
    working_set = sum(prefix_tokens)
    dtype = resolve_here(args.dtype)
    token_bytes = bytes_per_token(dtype)
    kv_cache_gib = cache_gib(args.kv_cache_gib, args.cache_fraction * working_set + longest_prompt + args.max_tokens,
                             dtype)
    per_worker_tokens = kv_cache_tokens(kv_cache_gib, dtype)
    popularity = Counter(r.repository for r in workload)
    console.print(f"workload: {len(workload)} requests over {workload[-1].arrival_seconds:.0f} s, "
                  f"{config.repositories} repositories, prefixes {min(prefix_tokens)}-{max(prefix_tokens)} tokens, "
                  f"working set {working_set} tokens ({working_set * token_bytes / 2**30:.3f} GiB); "
                  f"KV cache per worker {kv_cache_gib:.3f} GiB = {per_worker_tokens:.0f} tokens "
                  f"({per_worker_tokens / working_set:.0%} of the working set)", highlight=False)

    cluster, waited = start_cluster(args, kv_cache_gib, dtype, output)
    items = [workload_item(request) for request in workload]
    runs = measure(cluster, items, args.policies, args.warm_requests, args.wait_quiet,
                   lambda running: warm_up(running, config, count))
    result = run_record(args, cluster, runs, waited, kv_cache_gib, dtype)
    result["workload"] = {
        "config": asdict(config), "prefix_tokens": prefix_tokens, "working_set_tokens": working_set,
        "longest_prompt_tokens": longest_prompt, "requests_per_repository": dict(sorted(popularity.items())),
        **result["workload"]}
    report(output, result, runs, "Placement policies, repository-assistant workload")
    return 1 if runs.aborted else 0


COMMAND = Command("placement", "placement policies on a cluster it starts, repository-assistant workload",
                  __doc__, add_arguments, run, check)
parse_args, main = COMMAND.parse_args, COMMAND.main
