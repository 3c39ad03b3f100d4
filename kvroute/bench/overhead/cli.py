"""Measure the orchestrator's overhead: the HTTP API against driving the workers directly.

One run starts the embedded stack (``python -m kvroute serve``: orchestrator + one
prefill and one decode worker) as a subprocess, waits for ``/health``, looks the
workers' RPC addresses up in ``/admin/workers`` and then measures, interleaved so that
drift and noise fall on both sides alike,

1. N small requests (a fixed short token-id prompt, ``max_tokens`` 4, greedy,
   ``ignore_eos``) through the orchestrator's ``/v1/completions``, non-streaming
   (latency) and streaming (time to the first SSE event), with a minimal keep-alive
   HTTP/1.1 client (``kvroute.bench.lean_http``) so that the client library's CPU time,
   which shares these cores, is not counted as the orchestrator's; and non-streaming once
   more with httpx, to show what a general-purpose client adds;
2. the same work on the same two workers through the library driver
   (``orchestrator.disagg.generate_disaggregated`` over ``WorkerClient``), which is
   what the orchestrator runs per request minus HTTP, JSON, placement and
   detokenization;
3. throughput with C concurrent clients both ways, in alternating rounds.

The orchestrator runs with ``--policy least_loaded`` by default: like the direct path, it
then always prefills on the prefill worker and decodes on the decode worker. (The
cache-aware planner may choose a LOCAL plan, which is different work, and answers 429
at its concurrency cap; 429s are retried and counted.) Besides wall-clock times, the
orchestrator process's CPU time per HTTP request is reported (from /proc, less its CPU
time during the direct requests, which it does not serve), which a busy machine disturbs
far less.

It reports p50/p90 of each, the added p50 latency (target: at most 5 ms per request),
and the throughputs. Results go to ``results.json`` under ``--output`` (default
``results/measure_orchestrator``, next to the stack's log); a table is printed. The
stack is stopped with SIGINT at the end, also on errors and Ctrl-C.

Usage::

    kvroute bench orchestrator [--output DIR] [--requests N] [--concurrency C]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path

import httpx
from rich.table import Table

from kvroute.bench.command import Command
from kvroute.bench.overhead.clients import PROMPT_TOKEN_IDS
from kvroute.bench.overhead.measure import console, measure
from kvroute.bench.paths import results_path
from testing.stack import Stack, SyntheticStack


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, default=Path("results/measure_orchestrator"),
                        help="folder for results.json and the stack's log, or a path ending in .json "
                             "(default: %(default)s)")
    parser.add_argument("--requests", type=int, default=40,
                        help="sequential requests per mode (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="unmeasured requests per mode first (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8,
                        help="concurrent clients for throughput (default: %(default)s)")
    parser.add_argument("--throughput-requests", type=int, default=32,
                        help="requests per mode and round in the throughput test (default: %(default)s)")
    parser.add_argument("--throughput-rounds", type=int, default=3,
                        help="alternating rounds per mode in the throughput test (default: %(default)s)")
    parser.add_argument("--dtype", default="auto",
                        help="engine dtype; auto: bfloat16 where the hardware computes it natively, else "
                             "float32 (default: %(default)s)")
    parser.add_argument("--policy", default="least_loaded",
                        help="the orchestrator's placement policy (default: %(default)s, a baseline that always "
                             "prefills on the prefill worker and decodes on the decode worker, i.e. the same "
                             "work as the direct path; cache_aware may choose LOCAL plans and answer 429)")
    parser.add_argument("--engine", choices=("vllm", "synthetic"), default="vllm",
                        help="vllm: the embedded default with real engines; synthetic: `kvroute orchestrator` "
                             "with workers whose engines answer in fixed time (testing.synthetic_worker), which "
                             "isolates the orchestrator's cost from engine jitter (default: %(default)s)")
    parser.add_argument("--token-seconds", type=float, default=0.005,
                        help="synthetic engines: seconds per output token after the first (default: %(default)s)")
    parser.add_argument("--serve-args", default="", help="extra flags for `kvroute serve`, one string")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for /health")
    parser.add_argument("--request-timeout", type=float, default=120.0)


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.2f}"


def start_stack(log_path: Path, args: argparse.Namespace) -> Stack | SyntheticStack:
    if args.engine == "synthetic":
        from foundation.model_prep import resolve_model
        return SyntheticStack(resolve_model(None, progress=True), log_path,
                              ["--policy", args.policy, *args.serve_args.split()], args.token_seconds)
    return Stack(None, log_path, ["--dtype", args.dtype, "--policy", args.policy, *args.serve_args.split()])


def print_report(results: dict) -> None:
    m = results["measurements"]
    table = Table(title=f"Orchestrator overhead ({results['config']['requests']} interleaved requests per kind, "
                        f"{len(PROMPT_TOKEN_IDS)}-token prompt, max_tokens {results['config']['max_tokens']})")
    for column in ("measure", "p50 ms", "p90 ms", "mean ms"):
        table.add_column(column, justify="right" if column != "measure" else "left")
    rows = [("latency via HTTP API (non-streaming)", m["latency"]["http"]),
            ("latency direct (generate_disaggregated)", m["latency"]["direct"]),
            ("latency via HTTP API (streaming)", m["latency"]["http_stream"]),
            ("latency via HTTP API, httpx client", m["latency"]["http_httpx"]),
            ("TTFT via HTTP API (streaming)", m["ttft"]["http_stream"]),
            ("TTFT direct", m["ttft"]["direct"]),
            ("paired diff HTTP − direct, latency", m["added"]["paired_latency_diff"]),
            ("paired diff HTTP − direct, TTFT", m["added"]["paired_ttft_diff"])]
    for name, s in rows:
        table.add_row(name, ms(s["p50"]), ms(s["p90"]), ms(s["mean"]))
    console.print(table)
    added = m["added"]
    verdict = "[green]meets[/green]" if added["meets_target"] else "[red]misses[/red]"
    console.print(f"added p50 latency: {ms(added['p50_latency_s'])} ms ({verdict} the "
                  f"{ms(added['target_p50_s'])} ms target); added p50 TTFT: {ms(added['p50_ttft_s'])} ms; "
                  f"with httpx as the client: {ms(added['p50_latency_httpx_client_s'])} ms")
    cpu = m["orchestrator_cpu"]
    console.print(f"orchestrator CPU added per HTTP request (vs its CPU during direct requests): "
                  f"{ms(cpu['added_per_request_s'])} ms non-streaming, {ms(cpu['added_per_stream_request_s'])} ms "
                  f"streaming, {ms(cpu['throughput_added_per_request_s'])} ms at "
                  f"{results['config']['concurrency']} concurrent")

    rates = Table(title=f"Throughput, {results['config']['concurrency']} concurrent clients")
    for column in ("path", "requests", "req/s", "output tok/s", "per-round req/s", "p50 ms", "p90 ms"):
        rates.add_column(column, justify="right" if column != "path" else "left")
    for name, label in (("http", "HTTP API"), ("direct", "direct")):
        r = m["throughput"][name]
        rates.add_row(label, str(r["requests"]), f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}",
                      ", ".join(f"{x:.2f}" for x in r["rounds_requests_per_s"]),
                      ms(r["latency"]["p50"]), ms(r["latency"]["p90"]))
    console.print(rates)
    http_rate, direct_rate = m["throughput"]["http"]["requests_per_s"], m["throughput"]["direct"]["requests_per_s"]
    console.print(f"HTTP API / direct throughput: {http_rate / direct_rate:.3f}; "
                  f"429 answers retried: {m['rejected_429']}")
    failures = {name: len(errors) for name, errors in m["failed_sequential"].items() if errors}
    failures.update({f"throughput {name}": len(r["errors"]) for name, r in m["throughput"].items() if r["errors"]})
    if failures:
        console.print(f"[yellow]failed requests (left out of the statistics): {failures}[/yellow]")


def run(args: argparse.Namespace) -> int:
    out_file = results_path(args.output)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    log_path = out_file.parent / "serve.log"
    stack = start_stack(log_path, args)
    console.print(f"started `{' '.join(stack.command[1:])}` (pid {stack.process.pid}); log: {log_path}")
    results: dict = {}
    try:
        startup_s = stack.wait_healthy(args.start_timeout)
        model_name = httpx.get(stack.url + "/v1/models", timeout=5).json()["data"][0]["id"]
        workers = httpx.get(stack.url + "/admin/workers", timeout=5).json()["workers"]
        console.print(f"healthy after {startup_s:.0f} s; model '{model_name}'; workers: "
                      + ", ".join(f"{w['role']} {w['rpc_address']}" for w in workers))
        measurements = asyncio.run(measure(args, stack.url, model_name, workers, stack.process.pid))
        results = {
            "config": {"requests": args.requests, "warmup": args.warmup, "max_tokens": args.max_tokens,
                       "prompt_token_ids": PROMPT_TOKEN_IDS, "concurrency": args.concurrency,
                       "throughput_requests": args.throughput_requests,
                       "throughput_rounds": args.throughput_rounds, "dtype": args.dtype, "policy": args.policy,
                       "engine": args.engine,
                       "token_seconds": args.token_seconds if args.engine == "synthetic" else None,
                       "serve_command": stack.command[1:]},
            "environment": {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            "stack": {"startup_s": startup_s, "model": model_name, "workers": workers},
            "measurements": measurements,
        }
        out_file.write_text(json.dumps(results, indent=2))
        print_report(results)
    finally:
        code = stack.stop()
        console.print(f"stack stopped (exit code {code})")
    return 0


COMMAND = Command("orchestrator", "the orchestrator's overhead: its HTTP API against driving the workers directly",
                  __doc__, add_arguments, run)
parse_args, main = COMMAND.parse_args, COMMAND.main
