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

    .venv/bin/python scripts/measure_orchestrator.py [--output DIR] [--requests N] [--concurrency C]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the project is run from its checkout, not installed
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from kvroute.bench.lean_http import LeanConnection  # noqa: E402
from testing.stack import Stack, SyntheticStack  # noqa: E402

console = Console()

TARGET_ADDED_P50_S = 0.005  # the goal: the orchestrator adds at most 5 ms per request at p50
# A fixed prompt of plain token ids, shorter than one KV block: no prefix-cache hit can
# make one request cheaper than another, so every request does the same work.
# SmolLM2's tokens for "The capital of France is Paris. The capital of Italy is Rome. The
# capital of Germany is" (19 tokens).
PROMPT_TOKEN_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 7158, 314, 7268, 30, 378, 3575, 282,
                    4521, 314]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("results/measure_orchestrator"),
                        help="folder for results.json and the stack's log, or a path ending in .json "
                             "(default: %(default)s)")
    parser.add_argument("--requests", type=int, default=40, help="sequential requests per mode (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured requests per mode first (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent clients for throughput (default: %(default)s)")
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
    return parser.parse_args(argv)


# ---------------------------------------------------------------- small helpers


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(samples: list[float]) -> dict:
    return {"n": len(samples), "p50": percentile(samples, 50), "p90": percentile(samples, 90),
            "mean": statistics.fmean(samples) if samples else None,
            "min": min(samples, default=None), "max": max(samples, default=None), "samples": samples}


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.2f}"


def results_path(output: Path) -> Path:
    return output if output.suffix == ".json" else output / "results.json"


class CpuMeter:
    """CPU seconds (user + system, all threads) one process has used, from /proc/PID/stat.

    The orchestrator's CPU time per request is far less sensitive to a busy machine than
    wall-clock latency, so it backs the latency difference up.
    """

    def __init__(self, pid: int):
        self.pid = pid
        self.tick = os.sysconf("SC_CLK_TCK")

    def read(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self.tick  # utime, stime

    def idle_rate(self, seconds: float) -> float:
        """CPU seconds per second while nothing is asked of it (heartbeats, timers)."""
        before = self.read()
        time.sleep(seconds)
        return (self.read() - before) / seconds


def start_stack(log_path: Path, args: argparse.Namespace) -> Stack | SyntheticStack:
    if args.engine == "synthetic":
        from foundation.model_prep import resolve_model
        return SyntheticStack(resolve_model(None), log_path, ["--policy", args.policy, *args.serve_args.split()],
                              args.token_seconds)
    return Stack(None, log_path, ["--dtype", args.dtype, "--policy", args.policy, *args.serve_args.split()])


# ---------------------------------------------------------------- one request each way


class Paths:
    """The two ways to run the same request, sharing one event loop."""

    def __init__(self, args: argparse.Namespace, url: str, model_name: str, prefill_address: str,
                 decode_address: str):
        from foundation import wire
        from orchestrator.worker_client import WorkerClient

        self.args = args
        self.model_name = model_name
        limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2)
        self.http = httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits)
        parsed = httpx.URL(url)
        self.host, self.port = parsed.host, parsed.port
        # Idle lean connections, one per concurrent client at most. The lean client keeps the
        # client library's own CPU time, which shares these cores, out of the orchestrator's
        # overhead; the httpx kind shows what a general-purpose client adds on top.
        self.lean: list[LeanConnection] = []
        self.prefill = WorkerClient(prefill_address)
        self.decode = WorkerClient(decode_address)
        # What orchestrator.api._job builds for temperature 0, ignore_eos, no seed.
        self.sampling = wire.SamplingSpec(max_tokens=args.max_tokens, temperature=0.0, top_p=1.0,
                                          ignore_eos=True)
        self.body = {"model": model_name, "prompt": PROMPT_TOKEN_IDS, "max_tokens": args.max_tokens,
                     "temperature": 0, "ignore_eos": True}
        self.meter: CpuMeter | None = None  # the orchestrator process, once known
        self.rejected = 0  # 429 answers (retried after a short pause, inside the measured time)
        self.idle_cpu_rate = 0.0

    async def close(self) -> None:
        await self.http.aclose()
        for connection in self.lean:
            await connection.close()
        await self.prefill.close()
        await self.decode.close()

    async def http_request(self) -> dict:
        return await self._completion(lean=True)

    async def http_request_httpx(self) -> dict:
        return await self._completion(lean=False)

    async def _completion(self, lean: bool) -> dict:
        start = time.perf_counter()
        status, body = await self._post(self.body, lean)
        while status == 429:
            self.rejected += 1
            await asyncio.sleep(0.05)
            status, body = await self._post(self.body, lean)
        elapsed = time.perf_counter() - start
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body}")
        tokens = body["usage"]["completion_tokens"]
        if tokens != self.args.max_tokens:
            raise RuntimeError(f"expected {self.args.max_tokens} tokens through the API, got {tokens}: {body}")
        return {"latency_s": elapsed, "text": body["choices"][0]["text"]}

    async def _post(self, body: dict, lean: bool) -> tuple[int, dict]:
        if not lean:
            response = await self.http.post("/v1/completions", json=body)
            return response.status_code, response.json()
        connection = self.lean.pop() if self.lean else LeanConnection(self.host, self.port)
        try:
            return await connection.post_json("/v1/completions", body)
        finally:
            self.lean.append(connection)

    async def _events(self, body: dict) -> AsyncIterator[str]:
        connection = self.lean.pop() if self.lean else LeanConnection(self.host, self.port)
        try:
            async for data in connection.post_sse("/v1/completions", body):
                yield data
        finally:
            self.lean.append(connection)

    async def http_stream(self) -> dict:
        start = time.perf_counter()
        first = None
        text = []
        async with aclosing(self._events({**self.body, "stream": True})) as events:
            async for data in events:
                if data == "[DONE]":
                    continue  # read on to the end of the body: the connection is reused
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"stream error: {event}")
                if event.get("choices"):
                    first = first or time.perf_counter()
                    text.append(event["choices"][0]["text"])
        done = time.perf_counter()
        return {"ttft_s": first - start, "latency_s": done - start, "text": "".join(text)}

    async def direct(self) -> dict:
        from orchestrator.disagg import HandoffRecord, generate_disaggregated

        record = HandoffRecord(request_id=f"direct-{uuid.uuid4().hex}")
        start = time.perf_counter()
        first = None
        async for chunk in generate_disaggregated(self.prefill, self.decode, record, list(PROMPT_TOKEN_IDS),
                                                  self.sampling, None, self.args.request_timeout):
            if chunk.token_ids and first is None:
                first = time.perf_counter()
        elapsed = time.perf_counter() - start
        if len(record.token_ids) != self.args.max_tokens:
            raise RuntimeError(f"expected {self.args.max_tokens} tokens directly, got {record.token_ids}")
        return {"latency_s": elapsed, "ttft_s": first - start, "token_ids": list(record.token_ids)}


# ---------------------------------------------------------------- measurements


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


async def sequential(paths: Paths, n: int) -> dict:
    """N rounds of the three request kinds; the order rotates every round."""
    kinds = {"http": paths.http_request, "direct": paths.direct, "http_stream": paths.http_stream,
             "http_httpx": paths.http_request_httpx}
    names = list(kinds)
    samples: dict[str, list[dict]] = {name: [] for name in names}
    cpu_before, wall_before = (paths.meter.read() if paths.meter else 0.0), time.perf_counter()
    for i in range(n):
        order = names[i % len(names):] + names[:i % len(names)]
        if i % 2:
            order.reverse()  # both rotations and reversals: every kind goes first, middle and last
        for name in order:
            cpu_start = paths.meter.read() if paths.meter else 0.0
            sample = await attempt(kinds[name])
            sample["orchestrator_cpu_s"] = (paths.meter.read() if paths.meter else 0.0) - cpu_start
            samples[name].append(sample)
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
    for r in range(args.throughput_rounds):
        order = list(kinds) if r % 2 == 0 else list(kinds)[::-1]
        for name in order:
            rounds[name].append(await closed_loop(kinds[name], args.throughput_requests, args.concurrency,
                                                  paths.meter))
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
        await sequential(paths, args.warmup)
        console.print(f"sequential: {args.requests} request(s) per kind, interleaved")
        samples = await sequential(paths, args.requests)
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


# ---------------------------------------------------------------- report


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
                       "engine": args.engine, "token_seconds": args.token_seconds if args.engine == "synthetic" else None,
                       "serve_command": stack.command[1:]},
            "environment": {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            "stack": {"startup_s": startup_s, "model": model_name, "workers": workers},
            "measurements": measurements,
        }
        out_file.write_text(json.dumps(results, indent=2))
        print_report(results)
        console.print(f"results: {out_file}")
    finally:
        code = stack.stop()
        console.print(f"stack stopped (exit code {code})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
