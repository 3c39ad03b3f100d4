"""Overload the orchestrator on loopback and check that it degrades gracefully.

One run:

1. starts a stack: ``--engine synthetic`` (default; ``kvroute orchestrator`` with workers whose
   engines answer in fixed time) or ``--engine vllm`` (``kvroute serve`` with real engines);
2. measures capacity: closed-loop completions with ``--concurrency`` clients for
   ``--capacity-seconds``;
3. sends open-loop Poisson traffic at ``--overload`` times that capacity for ``--seconds``
   (bounded: at most rate × seconds requests, every request with a timeout);
4. after the load: waits for the orchestrator to drain, then sends ``--after`` normal requests.

It reports, as JSON in ``--output`` and as a table: answers by status, 429s and whether they
carried ``Retry-After``, accepted requests lost (an accepted stream that did not end with all
its tokens and ``[DONE]``, which must be zero), the orchestrator's resident memory over time
(it must stay bounded), and latency before and after the load.

Usage::

    kvroute bench load [--engine synthetic|vllm] [--overload 5] [--seconds 60]

Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
import psutil
from rich.console import Console

from foundation.model_prep import resolve_model
from kvroute.bench.command import Command
from kvroute.bench.progress import Bar
from simulator.records import percentile
from testing.stack import Stack, SyntheticStack

console = Console()
MODEL = "SmolLM2-135M-Instruct"
REQUEST_TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("synthetic", "vllm"), default="synthetic")
    parser.add_argument("--output", type=Path, default=Path("results/load_test"))
    parser.add_argument("--overload", type=float, default=5.0, help="offered load / measured capacity")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the overload phase")
    parser.add_argument("--capacity-seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8, help="clients while measuring capacity")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--after", type=int, default=20, help="normal requests after the load")
    parser.add_argument("--token-seconds", type=float, default=0.02, help="synthetic engines: per output token")
    parser.add_argument("--serve-args", default="--max-in-flight-per-worker 8 --admission-wait-seconds 2",
                        help="extra orchestrator flags (default: %(default)s)")


def start_stack(args: argparse.Namespace, log_path: Path):
    extra = ["--policy", "cache_aware", *args.serve_args.split()]
    if args.engine == "synthetic":
        return SyntheticStack(resolve_model(None, progress=True), log_path, extra, args.token_seconds)
    return Stack(None, log_path, ["--dtype", "auto", *extra])


async def one_request(client: httpx.AsyncClient, index: int, max_tokens: int) -> dict:
    """Stream one completion; what came back, and whether an accepted stream was whole."""
    body = {"model": MODEL, "prompt": f"request {index}: tell me about load shedding", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
            if response.status_code != 200:
                await response.aread()
                return {"status": response.status_code, "latency_s": time.perf_counter() - started,
                        "retry_after": response.headers.get("retry-after")}
            tokens, done, error = 0, False, None
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]["message"]
                    elif event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
            whole = done and error is None and tokens == max_tokens
            return {"status": 200, "latency_s": time.perf_counter() - started, "whole": whole, "error": error}
    except httpx.HTTPError as failure:
        return {"status": "transport_error", "error": repr(failure), "latency_s": time.perf_counter() - started}


async def capacity(client: httpx.AsyncClient, args: argparse.Namespace) -> float:
    """Completed requests per second with ``concurrency`` closed-loop clients."""
    finished, deadline = 0, time.monotonic() + args.capacity_seconds

    async def loop(worker: int) -> None:
        nonlocal finished
        index = worker * 1_000_000
        while time.monotonic() < deadline:
            result = await one_request(client, index, args.max_tokens)
            finished += result["status"] == 200
            index += 1

    started = time.monotonic()
    await asyncio.gather(*(loop(w) for w in range(args.concurrency)))
    return finished / (time.monotonic() - started)


async def overload(client: httpx.AsyncClient, rate: float, args: argparse.Namespace) -> list[dict]:
    rng, tasks, started = random.Random(0), [], time.monotonic()
    next_at, index = 0.0, 0
    while next_at < args.seconds:
        await asyncio.sleep(max(0.0, started + next_at - time.monotonic()))
        tasks.append(asyncio.create_task(one_request(client, 10_000_000 + index, args.max_tokens)))
        index += 1
        next_at += rng.expovariate(rate)
    return await asyncio.gather(*tasks)


async def sample_memory(pid: int, samples: list, stop: asyncio.Event) -> None:
    process = psutil.Process(pid)
    started = time.monotonic()
    while not stop.is_set():
        samples.append((round(time.monotonic() - started, 1), process.memory_info().rss))
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass


async def drained(url: str, timeout: float = 120.0) -> float:
    """Seconds until the orchestrator has no completion in flight."""
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url) as client:
        while time.monotonic() - started < timeout:
            metrics = (await client.get("/metrics")).text
            line = next(line for line in metrics.splitlines() if line.startswith("kvroute_requests_in_flight "))
            if float(line.split()[1]) == 0:
                return time.monotonic() - started
            await asyncio.sleep(0.5)
    raise RuntimeError("the orchestrator did not drain after the load")


def latency_summary(results: list[dict]) -> dict:
    latencies = sorted(r["latency_s"] for r in results if r["status"] == 200)
    if not latencies:
        return {"n": 0}
    # P99: the sample of rank int(0.99 n), 0-based ("higher", the nearest rank at or above it).
    return {"n": len(latencies), "p50_s": statistics.median(latencies),
            "p99_s": percentile(latencies, 99, method="higher")}


async def exercise(args: argparse.Namespace, stack) -> dict:
    """Latency before, capacity, the overload, the drain, latency after; what came back."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=stack.url, limits=limits) as client:
        with Bar(console, "load test", 5) as phase:
            phase.step(f"{args.after} requests before the load")
            before = [await one_request(client, i, args.max_tokens) for i in range(args.after)]
            phase.step(f"capacity, {args.capacity_seconds:.0f} s")
            rate = await capacity(client, args)
            offered = rate * args.overload
            console.print(f"capacity {rate:.1f} req/s; offering {offered:.1f} req/s for {args.seconds:.0f} s")
            phase.step(f"overload, {args.seconds:.0f} s")
            memory: list = []
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_memory(stack.process.pid, memory, stop))
            results = await overload(client, offered, args)
            phase.step("drain")
            drain_s = await drained(stack.url)
            stop.set()
            await sampler
            phase.step(f"{args.after} requests after the load")
            after = [await one_request(client, i, args.max_tokens) for i in range(args.after)]
    statuses: dict[str, int] = {}
    for result in results:
        statuses[str(result["status"])] = statuses.get(str(result["status"]), 0) + 1
    accepted = [r for r in results if r["status"] == 200]
    rejected = [r for r in results if r["status"] == 429]
    rss = [value for _, value in memory]
    return {
        "capacity_requests_per_s": rate, "offered_requests_per_s": offered, "sent": len(results),
        "statuses": statuses, "accepted": len(accepted), "rejected_429": len(rejected),
        "rejected_with_retry_after": sum(1 for r in rejected if r.get("retry_after")),
        "accepted_lost": sum(1 for r in accepted if not r["whole"]),
        "server_errors": sum(1 for r in results if isinstance(r["status"], int) and r["status"] >= 500),
        "transport_errors": statuses.get("transport_error", 0),
        "drain_seconds": drain_s,
        "orchestrator_rss_bytes": {"first": rss[0], "max": max(rss), "last": rss[-1], "samples": memory},
        "latency_before": latency_summary(before), "latency_accepted_under_load": latency_summary(accepted),
        "latency_after": latency_summary(after),
        "after_all_ok": all(r["status"] == 200 and r["whole"] for r in after),
    }


def run(args: argparse.Namespace) -> int:
    args.output.mkdir(parents=True, exist_ok=True)
    stack = start_stack(args, args.output / "stack.log")
    try:
        stack.wait_healthy(900)
        result = asyncio.run(exercise(args, stack))
    finally:
        stack.stop()
    result["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.output / "results.json").write_text(json.dumps(result, indent=1))
    rss = result["orchestrator_rss_bytes"]
    console.print(f"sent {result['sent']}: {result['statuses']}; 429 with Retry-After "
                  f"{result['rejected_with_retry_after']}/{result['rejected_429']}; accepted and lost "
                  f"{result['accepted_lost']}; 5xx {result['server_errors']}")
    console.print(f"orchestrator RSS {rss['first'] / 2**20:.0f} → max {rss['max'] / 2**20:.0f} → "
                  f"{rss['last'] / 2**20:.0f} MiB; drained {result['drain_seconds']:.1f} s after the load")
    console.print(f"p50 latency before {result['latency_before'].get('p50_s', 0) * 1e3:.0f} ms, under load "
                  f"(accepted) {result['latency_accepted_under_load'].get('p50_s', 0) * 1e3:.0f} ms, after "
                  f"{result['latency_after'].get('p50_s', 0) * 1e3:.0f} ms; after the load all ok: "
                  f"{result['after_all_ok']}")
    ok = result["accepted_lost"] == 0 and result["server_errors"] == 0 and result["after_all_ok"]
    return 0 if ok else 1


COMMAND = Command("load", "overload the orchestrator on loopback and check that it degrades gracefully", __doc__,
                  add_arguments, run)
parse_args, main = COMMAND.parse_args, COMMAND.main
