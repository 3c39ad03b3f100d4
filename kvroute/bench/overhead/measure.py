"""What ``kvroute bench orchestrator`` measures: N rounds of every request kind, interleaved
so that drift and noise fall on all alike, then throughput with C concurrent clients both
ways in alternating rounds; summaries and the orchestrator's CPU time per request."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from rich.console import Console

from kvroute.bench.meters import CpuMeter
from kvroute.bench.overhead.clients import Paths
from kvroute.bench.progress import Bar
from simulator.records import percentile

console = Console()
TARGET_ADDED_P50_S = 0.005  # the goal: the orchestrator adds at most 5 ms per request at p50


def summary(samples: list[float]) -> dict:
    return {"n": len(samples), "p50": percentile(samples, 50), "p90": percentile(samples, 90),
            "mean": statistics.fmean(samples) if samples else None,
            "min": min(samples, default=None), "max": max(samples, default=None), "samples": samples}


async def attempt(call) -> dict:
    """One request; a failure (e.g. a worker timing out on a busy machine) is recorded, not fatal."""
    try:
        return await call()
    except Exception as error:  # noqa: BLE001 - any failure of one request is data, not a crash
        console.print(f"[yellow]request failed: {error!r}[/yellow]")
        return {"error": repr(error)}


def kinds_measured(samples: dict[str, list[dict]]) -> list[str]:
    return [name for name in samples if name != "orchestrator_cpu"]


def ok(samples: list[dict]) -> list[dict]:
    return [s for s in samples if "error" not in s]


async def sequential(paths: Paths, n: int, label: str) -> dict:
    """N rounds of the request kinds, under a bar named ``label``; the order rotates every round."""
    kinds = {"http": paths.http_request, "direct": paths.direct, "http_stream": paths.http_stream,
             "http_httpx": paths.http_request_httpx}
    names = list(kinds)
    samples: dict[str, list[dict]] = {name: [] for name in names}
    cpu_before, wall_before = (paths.meter.read() if paths.meter else 0.0), time.perf_counter()
    with Bar(console, label, n, unit="rounds", redraw=False) as bar:
        for i in range(n):
            order = names[i % len(names):] + names[:i % len(names)]
            if i % 2:
                order.reverse()  # both rotations and reversals: every kind goes first, middle and last
            for name in order:
                cpu_start = paths.meter.read() if paths.meter else 0.0
                sample = await attempt(kinds[name])
                sample["orchestrator_cpu_s"] = (paths.meter.read() if paths.meter else 0.0) - cpu_start
                samples[name].append(sample)
            bar.advance()
    samples["orchestrator_cpu"] = [{"cpu_s": (paths.meter.read() if paths.meter else 0.0) - cpu_before,
                                    "wall_s": time.perf_counter() - wall_before}]
    return samples


async def closed_loop(call, requests: int, concurrency: int, meter: CpuMeter | None) -> dict:
    """``requests`` calls by ``concurrency`` clients, each starting its next when one ends."""
    remaining = requests
    latencies: list[float] = []
    errors: list[str] = []

    async def client() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            result = await attempt(call)
            if "error" in result:
                errors.append(result["error"])
            else:
                latencies.append(result["latency_s"])

    cpu_before = meter.read() if meter else 0.0
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return {"requests": requests - len(errors), "errors": errors, "seconds": elapsed, "latencies_s": latencies,
            "orchestrator_cpu_s": (meter.read() if meter else 0.0) - cpu_before}


async def throughput(paths: Paths, args: argparse.Namespace) -> dict:
    kinds = {"http": paths.http_request, "direct": paths.direct}
    rounds: dict[str, list[dict]] = {name: [] for name in kinds}
    with Bar(console, "throughput", args.throughput_rounds * len(kinds), unit="runs", redraw=False) as bar:
        for r in range(args.throughput_rounds):
            order = list(kinds) if r % 2 == 0 else list(kinds)[::-1]
            for name in order:
                rounds[name].append(await closed_loop(kinds[name], args.throughput_requests, args.concurrency,
                                                      paths.meter))
                bar.advance()
    out = {}
    for name, runs in rounds.items():
        total = sum(run["requests"] for run in runs)
        seconds = sum(run["seconds"] for run in runs)
        latencies = [x for run in runs for x in run["latencies_s"]]
        cpu = sum(run["orchestrator_cpu_s"] for run in runs)
        out[name] = {"requests": total, "seconds": seconds, "requests_per_s": total / seconds,
                     "errors": [e for run in runs for e in run["errors"]],
                     "orchestrator_cpu_s": cpu,
                     "orchestrator_cpu_per_request_s": cpu / total,
                     "output_tokens_per_s": total * args.max_tokens / seconds,
                     "rounds_requests_per_s": [run["requests"] / run["seconds"] for run in runs],
                     "latency": {k: v for k, v in summary(latencies).items() if k != "samples"}}
    return out


async def measure(args: argparse.Namespace, url: str, model_name: str, workers: list[dict],
                  orchestrator_pid: int) -> dict:
    prefill = next(w for w in workers if w["role"] == "prefill")
    decode = next(w for w in workers if w["role"] == "decode")
    paths = Paths(args, url, model_name, prefill["rpc_address"], decode["rpc_address"])
    try:
        paths.meter = CpuMeter(orchestrator_pid)
        paths.idle_cpu_rate = await asyncio.to_thread(paths.meter.idle_rate, 3.0)
        console.print(f"warm-up: {args.warmup} request(s) per kind")
        await sequential(paths, args.warmup, "warm-up")
        console.print(f"sequential: {args.requests} request(s) per kind, interleaved")
        samples = await sequential(paths, args.requests, "sequential")
        console.print(f"throughput: {args.concurrency} concurrent clients, {args.throughput_rounds} round(s) "
                      f"of {args.throughput_requests} request(s) per kind, alternating")
        rates = await throughput(paths, args)
    finally:
        await paths.close()

    http_latency = summary([s["latency_s"] for s in ok(samples["http"])])
    direct_latency = summary([s["latency_s"] for s in ok(samples["direct"])])
    stream_ttft = summary([s["ttft_s"] for s in ok(samples["http_stream"])])
    stream_latency = summary([s["latency_s"] for s in ok(samples["http_stream"])])
    direct_ttft = summary([s["ttft_s"] for s in ok(samples["direct"])])
    # Paired differences: each HTTP request against the direct one of the same round.
    paired = [h["latency_s"] - d["latency_s"] for h, d in zip(samples["http"], samples["direct"])
              if "error" not in h and "error" not in d]
    paired_ttft = [h["ttft_s"] - d["ttft_s"] for h, d in zip(samples["http_stream"], samples["direct"])
                   if "error" not in h and "error" not in d]
    httpx_latency = summary([s["latency_s"] for s in ok(samples["http_httpx"])])
    failed = {name: [s["error"] for s in samples[name] if "error" in s] for name in kinds_measured(samples)}
    added_p50 = http_latency["p50"] - direct_latency["p50"]
    # The orchestrator's CPU time while each request ran. During a direct request it still
    # does its background work (heartbeats, the KV events the request causes), so the mean
    # over direct requests is the baseline that the HTTP requests' mean is compared with.
    cpu = samples.pop("orchestrator_cpu")[0]
    cpu_mean = {name: statistics.fmean(s["orchestrator_cpu_s"] for s in samples[name]) if samples[name] else None
                for name in kinds_measured(samples)}
    texts = {s["text"] for name in ("http", "http_stream", "http_httpx") for s in ok(samples[name])}
    direct_tokens = {tuple(s["token_ids"]) for s in ok(samples["direct"])}
    return {
        "latency": {"http": http_latency, "direct": direct_latency, "http_stream": stream_latency,
                    "http_httpx": httpx_latency},
        "ttft": {"http_stream": stream_ttft, "direct": direct_ttft},
        "added": {
            "p50_latency_s": added_p50,
            "p50_ttft_s": stream_ttft["p50"] - direct_ttft["p50"],
            "paired_latency_diff": {k: v for k, v in summary(paired).items()},
            "paired_ttft_diff": {k: v for k, v in summary(paired_ttft).items()},
            "p50_latency_httpx_client_s": httpx_latency["p50"] - direct_latency["p50"],
            "target_p50_s": TARGET_ADDED_P50_S,
            "meets_target": added_p50 <= TARGET_ADDED_P50_S,
        },
        "orchestrator_cpu": {
            "idle_rate_cpu_s_per_s": paths.idle_cpu_rate,
            "sequential_cpu_s": cpu["cpu_s"], "sequential_wall_s": cpu["wall_s"],
            "mean_during_request_s": cpu_mean,
            "added_per_request_s": cpu_mean["http"] - cpu_mean["direct"],
            "added_per_stream_request_s": cpu_mean["http_stream"] - cpu_mean["direct"],
            "throughput_added_per_request_s": (rates["http"]["orchestrator_cpu_per_request_s"]
                                               - rates["direct"]["orchestrator_cpu_per_request_s"])},
        "throughput": rates,
        "rejected_429": paths.rejected,
        "failed_sequential": failed,
        "outputs": {"http_texts": sorted(texts), "direct_token_ids": [list(t) for t in sorted(direct_tokens)]},
    }
