"""kvroute against what a user would run instead (plain vLLM, vLLM servers behind vllm-router), side by side.

Each system is started on this machine with the same model, dtype, block size (32), total KV
memory, prefix caching and context length, and replayed the same workloads at every swept rate
with kvroute's replay client. All systems stay up while one is measured, and the runs alternate
between them (the order reversed every other run; ``--repeats`` runs each), so that drift in
the machine's speed falls on every system alike; ``--sequential`` runs one system at a time
instead. Writes results.json
(per system, workload and rate: TTFT and TPOT P50/P99, E2E P50, hit rate, errors, SLO
attainment; goodput per system and workload; the winner of every metric and kvroute's ratio
to the best peer), latency_vs_rate.png and goodput.png, and prints the tables.

Systems: ``kvroute`` (``kvroute serve --topology T --total-kv-gib X``), ``vllm`` (one vLLM
server on all cores), ``router-cache_aware`` and ``router-kv_aware`` (N vLLM servers behind
vllm-router 0.1.17, installed on first use into .peers-venv/), ``router-pd`` (vllm-router's
P/D mode over vLLM servers joined by vLLM's NixlConnector; recorded as skipped, with the reason,
where the nixl package is missing). See docs/benchmarks.md.

Usage::

    kvroute bench peers [--systems kvroute,vllm,router-cache_aware,router-kv_aware,router-pd]
        [--workloads repository-assistant,long-output,conversation,trace] [--rates 0.25,0.5,1]
        [--requests 30] [--total-kv-gib 0.75] [--ttft-target 1.0] [--tpot-target 0.15]
        [--kvroute-topology auto] [--kvroute-args "..."] [--repeats 1] [--sequential]
        [--output results/bench_peers]
"""

from __future__ import annotations

import argparse
import shlex
import signal
from dataclasses import asdict
from pathlib import Path

from kvroute.bench.command import Command
from kvroute.bench.paths import DEFAULT_TRACE
from kvroute.bench.peers.plans import DEFAULT_SYSTEMS, ROUTER_PD, ROUTER_POLICIES, SYSTEMS
from kvroute.bench.peers.sources import WORKLOADS
from kvroute.topology import cpu_list


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--systems", default=",".join(DEFAULT_SYSTEMS),
        help=f"comma-separated systems, run in this order, of {', '.join(SYSTEMS)} (default: %(default)s)")
    add("--workloads", default="repository-assistant",
        help=f"comma-separated workloads: {', '.join(WORKLOADS)} (default: %(default)s)")
    add("--rates", default="0.25,0.5,1", help="comma-separated request rates (req/s) swept per workload "
                                              "(default: %(default)s)")
    add("--requests", type=int, default=30, help="requests per run (default: %(default)s)")
    add("--output", type=Path, default=Path("results/bench_peers"),
        help="folder for results.json, the plots and every process's log (default: %(default)s)")
    add("--total-kv-gib", type=float, default=0.75, help="KV memory of each system, all engines together "
                                                         "(default: %(default)s)")
    add("--dtype", default="auto", help="engine dtype of every system; auto: kvroute's choice for this machine "
                                        "(default: %(default)s)")
    add("--max-model-len", type=int, default=4096, help="context length of every engine (default: %(default)s)")
    add("--ttft-target", type=float, default=1.0, help="SLO: seconds to the first token (default: %(default)s)")
    add("--tpot-target", type=float, default=0.15, help="SLO: seconds per output token after the first "
                                                        "(default: %(default)s)")
    add("--kvroute-topology", default="auto", help="kvroute serve --topology (default: %(default)s)")
    add("--kvroute-args", default="", help="more flags for kvroute serve, one shell-quoted string")
    add("--vllm-args", default="", help="more flags for every vLLM server of the vllm and router peers")
    add("--router-args", default="", help="more flags for vllm-router")
    add("--tier-kv-multiple", type=float, default=8.0, help="kvroute-tier's node store: host memory in "
                                                            "multiples of --total-kv-gib (default: %(default)s)")
    add("--router-servers", type=int, default=2, help="vLLM servers behind vllm-router (default: %(default)s)")
    add("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace of the trace workload (default: %(default)s)")
    add("--seed", type=int, default=0, help="seed of every workload (default: %(default)s)")
    add("--warmup-requests", type=int, default=3, help="unmeasured requests after each system starts "
                                                       "(default: %(default)s)")
    add("--repeats", type=int, default=1, help="runs of each workload and rate on each system, alternated; the "
                                              "metrics are over all of them (default: %(default)s)")
    add("--sequential", action="store_true",
        help="start and measure one system at a time instead of keeping all up and alternating them run "
             "by run (needs memory for one system only; drift of the machine's speed then falls on the "
             "systems unevenly)")
    add("--start-timeout", type=float, default=900, help="seconds a system may take to start (default: %(default)s)")
    add("--request-timeout", type=float, default=600, help="seconds a response may fall silent (default: %(default)s)")


def _list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.systems, args.workloads = _list(args.systems), _list(args.workloads)
    unknown = [s for s in args.systems if s not in SYSTEMS] + [w for w in args.workloads if w not in WORKLOADS]
    if unknown or not args.systems or not args.workloads:
        parser.error(f"unknown or missing systems/workloads {unknown}; systems: {', '.join(SYSTEMS)}; "
                     f"workloads: {', '.join(WORKLOADS)}")
    try:
        args.rates = sorted({float(rate) for rate in _list(args.rates)})
    except ValueError:
        parser.error(f"--rates must be numbers, got {args.rates!r}")
    if not args.rates or min(args.rates) <= 0 or min(args.requests, args.router_servers, args.repeats) < 1:
        parser.error("--rates must be positive, --requests, --router-servers and --repeats at least 1")
    if args.total_kv_gib <= 0 or args.ttft_target <= 0 or args.tpot_target <= 0 or args.tier_kv_multiple <= 0:
        parser.error("--total-kv-gib, --tier-kv-multiple and the targets must be positive")
    if ROUTER_PD in args.systems and len(args.systems) > 1 and not args.sequential:
        # Measured: its two idle servers took 0.65 cores each, and kvroute's run beside them had a TPOT
        # P50 of 3.2 s against ~70 ms.
        parser.error("router-pd's idle vLLM servers keep a core busy each (the progress thread of vLLM's NIXL "
                     "agent), which would slow every system measured while it is up: add --sequential, or "
                     "measure router-pd alone")
    if "trace" in args.workloads and not args.trace.exists():
        parser.error(f"the trace workload needs --trace; {args.trace} does not exist")


def build_systems(args: argparse.Namespace, resources, log_dir: Path, say) -> list:
    """A ``Plan`` per system that can run here, a ``run.Skipped`` (with why) per one that cannot."""
    from foundation.netutil import free_port
    from kvroute.bench.peers import plans
    from kvroute.bench.peers.router_env import RouterUnavailable, ensure_router
    from kvroute.bench.peers.run import Skipped

    options = plans.PeerOptions(args.kvroute_topology, tuple(shlex.split(args.kvroute_args)),
                                tuple(shlex.split(args.vllm_args)), args.router_servers,
                                tuple(shlex.split(args.router_args)), tier_kv_multiple=args.tier_kv_multiple)
    built: list = []
    for name in args.systems:
        if name in (plans.KVROUTE, plans.KVROUTE_TIER):
            built.append(plans.kvroute_plan(resources, options, free_port, log_dir, tier=name == plans.KVROUTE_TIER))
        elif name == plans.VLLM:
            built.append(plans.vllm_plan(resources, options, free_port))
        elif name == ROUTER_PD and (why := plans.pd_skip_reason()):
            built.append(Skipped(name, why))
        else:
            try:
                binary = str(ensure_router(say=say))
            except RouterUnavailable as error:
                built.append(Skipped(name, f"vllm-router could not be installed: {error}"))
                continue
            routed = plans.PeerOptions(**{**asdict(options), "router_binary": binary})
            if name == ROUTER_PD:
                built.append(plans.router_pd_plan(resources, routed, free_port))
                continue
            policy = name.removeprefix("router-")
            assert policy in ROUTER_POLICIES
            built.append(plans.router_plan(policy, resources, routed, free_port))
    return built


def _stop_on_sigterm() -> None:
    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # so every started process is stopped on the way out


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvroute.bench.peers import plots, report, resources, results, run, sources, table

    console = Console()
    if not console.is_terminal:
        console.width = 160
    _stop_on_sigterm()
    output: Path = args.output
    log_dir = output / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    res = resources.resolve(args.dtype, args.total_kv_gib, args.max_model_len)
    console.print(f"every system: {res.served_model} ({res.model}), {res.dtype}, block size {res.block_size}, "
                  f"{res.total_kv_gib:g} GiB KV in all, max-model-len {res.max_model_len}, cores "
                  f"{cpu_list(res.cores)}, prefix caching on", highlight=False)
    targets = report.Targets(args.ttft_target, args.tpot_target)
    settings = run.SweepSettings(tuple(args.workloads), tuple(args.rates),
                                 sources.SourceSettings(args.requests, args.seed, args.trace, args.max_model_len),
                                 targets, args.start_timeout, args.request_timeout, args.warmup_requests,
                                 sequential=args.sequential, repeats=args.repeats)
    systems = build_systems(args, res, log_dir, lambda message: console.print(message, highlight=False))
    sweep = run.sweep(systems, settings, log_dir, console)
    comparisons = report.comparisons(sweep.metrics(), sweep.metrics_by_round())
    recorded = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    results.write(output / "results.json",
                  results.document(sweep, recorded, res.record(), targets, comparisons))
    table.print_report(console, sweep, comparisons, targets)
    if comparisons:
        plots.latency_vs_rate(sweep.metrics(), output / "latency_vs_rate.png")
        plots.goodput_bars(comparisons, output / "goodput.png", targets.attainment)
    return 1 if sweep.aborted else 0


COMMAND = Command("peers", "kvroute against plain vLLM and vllm-router on the same machine, side by side",
                  __doc__, add_arguments, run, check)
parse_args, main = COMMAND.parse_args, COMMAND.main
