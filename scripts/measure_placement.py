"""Compare placement policies on one cluster with the repository-assistant workload.

One run starts ONE embedded cluster (``python -m kvroute serve``: orchestrator, 2 prefill
workers, 1 decode worker, ``--allow-policy-override``) and, for each policy in turn,

1. empties every worker's prefix cache (``POST /admin/reset-cache``) and waits until the
   index is empty too, so every policy starts cold;
2. replays the same seeded workload (``kvroute.bench.workloads``: R repositories with long
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
block-level LRU simulation of the default workload (tail blocks evicted first, as vLLM
does) puts round-robin's hit rate at 40-50% at that size and a policy that keeps each
repository on one prefill worker at 70-80%. At a third of the working set both are lower
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

    .venv/bin/python scripts/measure_placement.py [--output DIR] [--policies cache_aware,round_robin]
        [--requests N] [--rate R] [--repositories K] [--seed S] [--kv-cache-gib G]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the project is run from its checkout, not installed
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from kvroute.bench.workloads import (RepositoryAssistantConfig, WorkloadRequest, estimate_prefix_tokens,  # noqa: E402
                                     generate_workload, load_tokenizer, prompt_tokens, repository_prefixes,
                                     tokenizer_counter)
from kvroute.netutil import free_port  # noqa: E402
from kvroute.worker.dtype import resolve_here  # noqa: E402

console = Console(width=170)  # the table is wide; also when the output goes to a file

ALL_POLICIES = ("cache_aware", "round_robin", "least_loaded", "prefix_affinity", "block_cost")
POLICY_HEADER = "X-KVRoute-Policy"
MODEL = "SmolLM2-135M-Instruct"
# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x K,V, times the dtype's bytes.
KV_ELEMENTS_PER_TOKEN = 30 * 3 * 64 * 2
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
PREFILL_WORKERS, DECODE_WORKERS = 2, 1
MAX_MODEL_LEN = 4096
START_TIMEOUT_S = 900
RESET_IDLE_TIMEOUT_S = 120
RESET_ATTEMPTS = 5
REQUEST_TIMEOUT_S = 180


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("results/measure_placement"),
                        help="folder for results.json, plots and the cluster's log (default: %(default)s)")
    parser.add_argument("--policies", default=",".join(ALL_POLICIES),
                        help="comma-separated policies, run in this order (default: all five)")
    parser.add_argument("--requests", type=int, default=120, help="requests per policy (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=0.9, help="Poisson arrival rate, requests/s (default: %(default)s)")
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
    args = parser.parse_args(argv)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in args.policies if p not in ALL_POLICIES]
    if unknown or not args.policies:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(ALL_POLICIES)}")
    return args


# ---------------------------------------------------------------- the cluster


class Cluster:
    """``python -m kvroute serve`` in its own session; stopped with SIGINT like Ctrl-C."""

    def __init__(self, port: int, kv_cache_gib: float, dtype: str, log_path: Path):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.args = [sys.executable, "-m", "kvroute", "serve", "--port", str(port),
                     "--prefill-workers", str(PREFILL_WORKERS), "--decode-workers", str(DECODE_WORKERS),
                     "--allow-policy-override", "--kv-cache-gib", f"{kv_cache_gib:.4f}", "--dtype", dtype,
                     "--max-model-len", str(MAX_MODEL_LEN), "--log-dir", str(log_path.parent / "workers")]
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            cwd=REPO_ROOT, start_new_session=True)

    def wait_ready(self, timeout: float) -> list[dict]:
        """Until every worker registered (``/health`` needs only one of each role)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvroute serve exited early:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    workers = self.workers()
                    roles = Counter(w["role"] for w in workers)
                    if roles["prefill"] >= PREFILL_WORKERS and roles["decode"] >= DECODE_WORKERS:
                        return workers
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"kvroute serve not ready after {timeout:.0f} s; see {self.log_path}")

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/admin/workers", timeout=10).json()["workers"]

    def stop(self, timeout: float = 60) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            console.print("[yellow]cluster did not stop in time; SIGKILL to its process group[/]")
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait(10)


TINY_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2,
             "temperature": 0, "ignore_eos": True}


def wait_idle(cluster: Cluster, timeout: float) -> bool:
    """Until no worker runs or queues a request (stragglers of the previous policy)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = cluster.workers()
        if all(w["in_flight"] == 0 and w["load"]["num_running"] == 0 and w["load"]["num_waiting"] == 0
               for w in workers):
            return True
        time.sleep(1)
    console.print(f"[yellow]  workers still busy {timeout:.0f} s after the last request: "
                  f"{[(w['worker_id'], w['in_flight'], w['load']['num_running']) for w in cluster.workers()]}[/]")
    return False


def reset_cache(cluster: Cluster, timeout: float = 30) -> dict:
    """Empty every worker's prefix cache, then wait until the index is empty too.

    An idle vLLM engine publishes the ``AllBlocksCleared`` event of a reset only at its next
    step, so until then the worker's snapshot, and the index reloaded from it, still list
    the old blocks. Two tiny round-robin requests (shorter than a block: they store
    nothing) make every engine step. Returns the reset reply plus the index blocks left.
    """
    body: dict = {"idle_before_reset": wait_idle(cluster, RESET_IDLE_TIMEOUT_S)}
    for attempt in range(1, RESET_ATTEMPTS + 1):
        reply = httpx.post(cluster.url + "/admin/reset-cache", timeout=60)
        try:
            body = {**body, **reply.json(), "attempts": attempt}
        except ValueError:
            body = {**body, "reset": False, "workers": reply.text[:300], "attempts": attempt}
        if reply.status_code == 200 and body.get("reset"):
            break
        console.print(f"[yellow]  reset-cache attempt {attempt} failed: {reply.status_code} {body.get('workers')}[/]")
        time.sleep(5)
    else:  # measure anyway, but say so: this policy does not start cold
        console.print("[red]  reset-cache kept failing; this policy starts with whatever the caches hold[/]")
    body["index_blocks_after_reset"] = {w["worker_id"]: w["index_blocks"] for w in cluster.workers()}
    for _ in range(PREFILL_WORKERS):
        httpx.post(cluster.url + "/v1/chat/completions", json=TINY_BODY, headers={POLICY_HEADER: "round_robin"},
                   timeout=REQUEST_TIMEOUT_S).raise_for_status()
    deadline = time.monotonic() + timeout
    while True:
        workers = cluster.workers()
        left = {w["worker_id"]: w["index_blocks"] for w in workers}
        if all(w["index_blocks"] == 0 and w["in_flight"] == 0 for w in workers) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    body["index_blocks_at_start"] = left
    if any(left.values()):
        console.print(f"[yellow]  the index still lists blocks {timeout:.0f} s after reset-cache: {left}[/]")
    return body


# ---------------------------------------------------------------- other people's load

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _busy_ticks() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # all but idle and iowait


def _own_ticks() -> int:
    """CPU ticks of this script and all its descendants (the cluster, its workers, their engines),
    those of reaped children included, so the sum does not drop when a process exits."""
    ticks, parents = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        ticks[pid] = sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    me, total = os.getpid(), 0
    for pid, own in ticks.items():
        ancestor, hops = pid, 0
        while ancestor not in (me, 0, 1) and hops < 64:
            ancestor, hops = parents.get(ancestor, 0), hops + 1
        if ancestor == me:
            total += own
    return total


class ForeignLoad:
    """CPU cores used since creation by processes other than this script and its descendants."""

    def __init__(self):
        self.started, self.busy, self.own = time.monotonic(), _busy_ticks(), _own_ticks()

    def cores(self) -> float:
        elapsed = max(time.monotonic() - self.started, 1e-3)
        busy, own = _busy_ticks() - self.busy, _own_ticks() - self.own
        return max(busy - own, 0) / CLOCK_TICKS / elapsed


def wait_for_quiet(budget: float, threshold: float = 0.3, window: float = 5.0) -> float:
    """Wait (at most ``budget`` s) until other processes use < ``threshold`` cores; returns the wait."""
    started = time.monotonic()
    while time.monotonic() - started < budget:
        meter = ForeignLoad()
        time.sleep(window)
        load = meter.cores()
        if load < threshold:
            break
        console.print(f"  other processes use {load:.2f} cores; waiting for a quieter machine", highlight=False)
    else:
        if budget > 0:
            console.print("[yellow]  --wait-quiet budget spent; measuring under load[/]")
    return time.monotonic() - started


# ---------------------------------------------------------------- one request


@dataclass
class Row:
    policy: str
    index: int
    repository: int
    scheduled_s: float
    sent_s: float = math.nan  # since the run's start
    status: int = 0
    error: str | None = None
    response_id: str | None = None
    ttft_s: float | None = None
    second_token_s: float | None = None  # first → second content chunk
    itl_s: float | None = None  # (last − first content chunk) / (completion tokens − 1)
    e2e_s: float | None = None
    content_chunks: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    # from the decision record
    decision_policy: str | None = None
    plan_kind: str | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    prefilling_worker: str | None = None  # the prefill worker (DISAGG) or the decode worker (LOCAL)
    predicted_reused_tokens: int | None = None
    actual_reused_tokens: int | None = None
    estimated_ttft_s: float | None = None
    estimated_gap_s: float | None = None
    server_ttft_s: float | None = None
    server_second_token_s: float | None = None
    server_e2e_s: float | None = None
    reason: str | None = None
    chunk_times: list[float] = field(default_factory=list, repr=False)


def request_body(request: WorkloadRequest) -> dict:
    return {"model": MODEL, "messages": request.messages, "max_tokens": request.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


async def send(client: httpx.AsyncClient, url: str, policy: str, request: WorkloadRequest, start: float) -> Row:
    row = Row(policy, request.index, request.repository, request.arrival_seconds)
    loop = asyncio.get_running_loop()
    sent = loop.time()
    row.sent_s = sent - start
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=request_body(request),
                                 headers={POLICY_HEADER: policy}) as response:
            row.status = response.status_code
            if response.status_code != 200:
                row.error = (await response.aread()).decode(errors="replace")[:500]
                return row
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = loop.time()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    row.error = json.dumps(chunk["error"])[:500]
                    continue
                row.response_id = row.response_id or chunk.get("id")
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        row.chunk_times.append(now - sent)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    row.prompt_tokens = usage["prompt_tokens"]
                    row.completion_tokens = usage["completion_tokens"]
                    row.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        row.e2e_s = loop.time() - sent
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        row.error = f"{type(error).__name__}: {error}"
    times = row.chunk_times
    row.content_chunks = len(times)
    if times:
        row.ttft_s = times[0]
    if len(times) >= 2:
        row.second_token_s = times[1] - times[0]
        if row.completion_tokens and row.completion_tokens > 1:
            row.itl_s = (times[-1] - times[0]) / (row.completion_tokens - 1)
    return row


async def attach_decision(client: httpx.AsyncClient, url: str, row: Row) -> None:
    if not row.response_id:
        return
    try:
        reply = await client.get(f"{url}/v1/decisions/{row.response_id}")
        if reply.status_code != 200:
            return
        record = reply.json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return
    chosen = record.get("chosen") or {}
    actual = record.get("actual") or {}
    row.decision_policy = record.get("policy")
    row.plan_kind = chosen.get("kind")
    row.prefill_worker = chosen.get("prefill_worker")
    row.decode_worker = chosen.get("decode_worker")
    row.prefilling_worker = row.prefill_worker or row.decode_worker
    row.predicted_reused_tokens = record.get("predicted_reused_tokens")
    row.actual_reused_tokens = actual.get("reused_tokens")
    row.estimated_ttft_s = (chosen.get("estimate") or {}).get("ttft")
    row.estimated_gap_s = (chosen.get("estimate") or {}).get("gap")
    row.server_ttft_s = actual.get("ttft")
    row.server_second_token_s = actual.get("second_token_gap")
    row.server_e2e_s = actual.get("e2e")
    row.reason = record.get("reason")


async def replay(url: str, policy: str, workload: list[WorkloadRequest]) -> tuple[list[Row], float]:
    """Open loop: request i is sent at its arrival time, whatever the earlier ones are doing."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.5
        tasks, done = [], 0

        def progress(_task) -> None:
            nonlocal done
            done += 1
            if done % 25 == 0 or done == len(workload):
                console.print(f"  {policy}: {done}/{len(workload)} done at {loop.time() - start:.0f} s", highlight=False)

        for request in workload:
            delay = start + request.arrival_seconds - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send(client, url, policy, request, start))
            task.add_done_callback(progress)
            tasks.append(task)
        rows = list(await asyncio.gather(*tasks))
        duration = loop.time() - start
        semaphore = asyncio.Semaphore(16)

        async def attach(row: Row) -> None:
            async with semaphore:
                await attach_decision(client, url, row)

        await asyncio.gather(*(attach(row) for row in rows))
    return rows, duration


# ---------------------------------------------------------------- summaries


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(policy: str, rows: list[Row], duration: float, labels: dict[str, str], foreign_cores: float,
              waited: float) -> dict:
    ok = [r for r in rows if r.error is None and r.ttft_s is not None]
    metric = lambda name: [getattr(r, name) for r in ok if getattr(r, name) is not None]  # noqa: E731
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    predicted = [r for r in ok if r.predicted_reused_tokens is not None and r.actual_reused_tokens is not None]
    summary = {
        "policy": policy, "foreign_cpu_cores": foreign_cores, "waited_for_quiet_s": waited, "requests": len(rows), "succeeded": len(ok), "errors": len(rows) - len(ok),
        "duration_s": duration, "throughput_rps": len(ok) / duration if duration > 0 else None,
        "hit_rate": cached / prompt if prompt else None, "prompt_tokens": prompt, "cached_tokens": cached,
        "max_send_lateness_s": max((r.sent_s - r.scheduled_s for r in rows), default=None),
        "wrong_policy_records": sum(r.decision_policy not in (None, policy) for r in rows),
        "missing_decision_records": sum(r.plan_kind is None for r in ok),
        "plan_kinds": dict(Counter(r.plan_kind for r in ok if r.plan_kind)),
        "prefilling_worker_counts": dict(Counter(labels.get(r.prefilling_worker, r.prefilling_worker)
                                                 for r in ok if r.prefilling_worker)),
        "decode_worker_counts": dict(Counter(labels.get(r.decode_worker, r.decode_worker)
                                             for r in ok if r.decode_worker)),
        # every request that got a plan, failed ones too: where the policy put the load
        "placed_prefilling_worker_counts": dict(Counter(labels.get(r.prefilling_worker, r.prefilling_worker)
                                                        for r in rows if r.prefilling_worker)),
        "predicted_reused_tokens": sum(r.predicted_reused_tokens for r in predicted),
        "actual_reused_tokens": sum(r.actual_reused_tokens for r in predicted),
        "overpredicted_requests": sum(r.actual_reused_tokens + 128 <= r.predicted_reused_tokens for r in predicted),
        "underpredicted_requests": sum(r.actual_reused_tokens >= r.predicted_reused_tokens + 128 for r in predicted),
        # a hand-off this slow is a failed pull (recomputed on the decode worker) or a starved process
        "slow_handoffs_over_5s": sum((r.second_token_s or 0) > 5 for r in ok),
    }
    for name, key in (("ttft", "ttft_s"), ("second_token", "second_token_s"), ("itl", "itl_s"), ("e2e", "e2e_s"),
                      ("server_ttft", "server_ttft_s"), ("server_second_token", "server_second_token_s")):
        values = metric(key)
        summary[f"{name}_p50_s"] = percentile(values, 50)
        summary[f"{name}_p99_s"] = percentile(values, 99)
        summary[f"{name}_mean_s"] = float(np.mean(values)) if values else None
    return summary


def ratios(summaries: dict[str, dict]) -> dict:
    out: dict = {}
    ca, rr = summaries.get("cache_aware"), summaries.get("round_robin")
    if ca and rr and ca["ttft_p50_s"] and rr["ttft_p50_s"]:
        out["cache_aware_over_round_robin_p50_ttft"] = ca["ttft_p50_s"] / rr["ttft_p50_s"]
    baselines = {name: s for name, s in summaries.items() if name != "cache_aware" and s["ttft_p99_s"]}
    if ca and ca["ttft_p99_s"] and baselines:
        best = min(baselines, key=lambda name: baselines[name]["ttft_p99_s"])
        out["best_baseline_p99_ttft"] = best
        out["cache_aware_over_best_baseline_p99_ttft"] = ca["ttft_p99_s"] / baselines[best]["ttft_p99_s"]
    return out


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def print_table(summaries: dict[str, dict], labels: list[str]) -> None:
    table = Table(title="Placement policies, repository-assistant workload (times in ms)")
    for column in ("policy", "ok/err", "hit rate", "TTFT p50", "TTFT p99", "2nd p50", "2nd p99", "ITL mean",
                   "E2E p50", "E2E p99", "LOCAL", "prefills " + "/".join(labels)):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, s in summaries.items():
        counts = s["prefilling_worker_counts"]
        table.add_row(
            name, f"{s['succeeded']}/{s['errors']}", "-" if s["hit_rate"] is None else f"{s['hit_rate']:.1%}",
            ms(s["ttft_p50_s"]), ms(s["ttft_p99_s"]), ms(s["second_token_p50_s"]), ms(s["second_token_p99_s"]),
            ms(s["itl_mean_s"]), ms(s["e2e_p50_s"]), ms(s["e2e_p99_s"]), str(s["plan_kinds"].get("local", 0)),
            "/".join(str(counts.get(label, 0)) for label in labels))
    console.print(table)


# ---------------------------------------------------------------- plots


def plot(output: Path, rows_by_policy: dict[str, list[Row]], summaries: dict[str, dict], labels: list[str]) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for policy, rows in rows_by_policy.items():
        values = np.sort([r.ttft_s for r in rows if r.error is None and r.ttft_s is not None])
        if len(values):
            axis.step(values * 1000, np.arange(1, len(values) + 1) / len(values), where="post", label=policy)
    axis.set_xscale("log")
    axis.set_xlabel("TTFT (ms, log scale)")
    axis.set_ylabel("fraction of requests")
    axis.set_title("TTFT CDF per policy")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(output / "ttft_cdf.png", dpi=120)
    plt.close(figure)
    written.append("ttft_cdf.png")

    names = list(summaries)
    figure, axis = plt.subplots(figsize=(7, 4))
    rates = [100 * (summaries[n]["hit_rate"] or 0) for n in names]
    bars = axis.bar(names, rates, color="tab:blue")
    axis.bar_label(bars, fmt="%.0f%%")
    axis.set_ylabel("cached / prompt tokens (%)")
    axis.set_ylim(0, 100)
    axis.set_title("Prefix-cache hit rate per policy")
    figure.tight_layout()
    figure.savefig(output / "hit_rate.png", dpi=120)
    plt.close(figure)
    written.append("hit_rate.png")

    figure, axis = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(labels), 1)
    positions = np.arange(len(names))
    for k, label in enumerate(labels):
        counts = [summaries[n].get("placed_prefilling_worker_counts", summaries[n]["prefilling_worker_counts"])
                  .get(label, 0) for n in names]
        axis.bar(positions + (k - (len(labels) - 1) / 2) * width, counts, width, label=label)
    axis.set_xticks(positions, names)
    axis.set_ylabel("requests placed")
    axis.set_title("Per-worker load: the worker each policy chose to prefill (all placed requests)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(output / "worker_load.png", dpi=120)
    plt.close(figure)
    written.append("worker_load.png")
    return written


# ---------------------------------------------------------------- main


def workload_config(args: argparse.Namespace) -> RepositoryAssistantConfig:
    return RepositoryAssistantConfig(
        repositories=args.repositories, requests=args.requests, rate=args.rate,
        prefix_min_tokens=args.prefix_min_tokens, prefix_max_tokens=args.prefix_max_tokens,
        zipf_exponent=args.zipf_exponent, max_tokens=args.max_tokens, seed=args.seed)


def worker_labels(workers: list[dict], log_dir: Path) -> dict[str, str]:
    """Worker id → "prefill@0"-style label naming the CPU core from the worker's log (the
    decode worker shares a core with a prefill worker); "prefill-0" style if logs lack it."""
    cores: dict[str, str] = {}
    for log in log_dir.glob("*.log"):
        text = log.read_text(errors="replace")
        worker = re.search(r'"worker_id": "([^"]+)"', text)
        core = re.search(r"core ids=\[([0-9, ]+)\]", text)
        if worker and core:
            cores[worker.group(1)] = core.group(1).replace(" ", "")
    labels: dict[str, str] = {}
    for role in ("prefill", "decode"):
        for k, wid in enumerate(sorted(w["worker_id"] for w in workers if w["role"] == role)):
            labels[wid] = f"{role}@{cores[wid]}" if wid in cores else f"{role}-{k}"
    if len(set(labels.values())) < len(labels):  # two workers of a role on one core
        labels = {wid: f"{label}#{k}" for k, (wid, label) in enumerate(labels.items())}
    return labels


def warm_up(cluster: Cluster, config: RepositoryAssistantConfig, count) -> None:
    """Unmeasured requests before the first policy, so that it does not pay for cold code paths.

    Their prompts are unrelated to the workload (another seed) and of several sizes: the
    orchestrator calibrates its link estimates from the pulls it sees, and pulls of one
    size cannot tell per-pull latency from bandwidth."""
    sizes = (256, 1536, 512, 1280, 768, 1024)
    for k, size in enumerate(sizes):
        warm = RepositoryAssistantConfig(repositories=1, requests=1, prefix_min_tokens=size, prefix_max_tokens=size,
                                         seed=config.seed + 1_000_003 + k)
        messages = [{"role": "system", "content": repository_prefixes(warm, count)[0]},
                    {"role": "user", "content": "Summarise this repository in one line."}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        httpx.post(cluster.url + "/v1/chat/completions", json=body, headers={POLICY_HEADER: "round_robin"},
                   timeout=REQUEST_TIMEOUT_S).raise_for_status()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    bytes_per_token = KV_ELEMENTS_PER_TOKEN * DTYPE_BYTES[dtype]
    auto_gib = (args.cache_fraction * working_set + longest_prompt + args.max_tokens) * bytes_per_token / 2**30
    kv_cache_gib = args.kv_cache_gib or round(auto_gib, 4)
    per_worker_tokens = kv_cache_gib * 2**30 / bytes_per_token
    popularity = Counter(r.repository for r in workload)
    console.print(f"workload: {len(workload)} requests over {workload[-1].arrival_seconds:.0f} s, "
                  f"{config.repositories} repositories, prefixes {min(prefix_tokens)}-{max(prefix_tokens)} tokens, "
                  f"working set {working_set} tokens ({working_set * bytes_per_token / 2**30:.3f} GiB); "
                  f"KV cache per worker {kv_cache_gib:.3f} GiB = {per_worker_tokens:.0f} tokens "
                  f"({per_worker_tokens / working_set:.0%} of the working set)", highlight=False)

    waited = wait_for_quiet(args.wait_quiet) if args.wait_quiet > 0 else 0.0
    port = args.port or free_port()
    cluster = Cluster(port, kv_cache_gib, dtype, output / "serve.log")
    console.print(f"cluster: {' '.join(cluster.args[1:])}", highlight=False)
    rows_by_policy: dict[str, list[Row]] = {}
    summaries: dict[str, dict] = {}
    names: dict[str, str] = {}
    started = time.monotonic()
    aborted = None
    try:
        startup_load = ForeignLoad()
        workers = cluster.wait_ready(START_TIMEOUT_S)
        console.print(f"cluster ready after {time.monotonic() - started:.0f} s (other processes used "
                      f"{startup_load.cores():.2f} cores meanwhile)", highlight=False)
        names = worker_labels(workers, output / "workers")
        console.print("workers: " + ", ".join(f"{label} = {wid}" for wid, label in names.items()), highlight=False)
        warm_up(cluster, config, count)
        for policy in args.policies:
            reset = reset_cache(cluster)
            quiet = wait_for_quiet(args.wait_quiet) if args.wait_quiet > 0 else 0.0
            waited += quiet
            time.sleep(1.0)
            console.print(f"[bold]{policy}[/]: replaying {len(workload)} requests", highlight=False)
            load = ForeignLoad()
            rows, duration = asyncio.run(replay(cluster.url, policy, workload))
            rows_by_policy[policy] = rows
            summaries[policy] = s = summarize(policy, rows, duration, names, load.cores(), quiet)
            s["reset_ok"], s["reset_attempts"] = bool(reset.get("reset")), reset.get("attempts")
            s["index_blocks_at_start"] = {names.get(k, k): v for k, v in reset["index_blocks_at_start"].items()}
            s["index_blocks_right_after_reset"] = {names.get(k, k): v
                                                   for k, v in reset["index_blocks_after_reset"].items()}
            console.print(f"  hit rate {s['hit_rate'] or 0:.1%}, TTFT p50 {ms(s['ttft_p50_s'])} ms "
                          f"p99 {ms(s['ttft_p99_s'])} ms, errors {s['errors']}, slow hand-offs "
                          f"{s['slow_handoffs_over_5s']}, other processes {s['foreign_cpu_cores']:.2f} cores",
                          highlight=False)
            for row in rows:
                if row.error:
                    console.print(f"  [red]request {row.index}: {row.status} {row.error}[/]", highlight=False)
                    break
    except (Exception, KeyboardInterrupt) as error:
        aborted = f"{type(error).__name__}: {error}"
        console.print(f"[red]aborted: {aborted}[/]")
    finally:
        code = cluster.stop()
        console.print(f"cluster stopped (exit code {code}) after {time.monotonic() - started:.0f} s",
                      highlight=False)

    result = {
        "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "kv_cache_gib_used": kv_cache_gib, "dtype": dtype, "cluster_command": cluster.args[1:]},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "waited_for_quiet_s": waited,
                    "load_average_at_end": os.getloadavg()},
        "aborted": aborted,
        "workload": {"config": asdict(config), "prefix_tokens": prefix_tokens, "working_set_tokens": working_set,
                     "longest_prompt_tokens": longest_prompt, "requests_per_repository": dict(sorted(popularity.items())),
                     "kv_cache_tokens_per_worker": per_worker_tokens},
        "workers": names,
        "summaries": summaries,
        "ratios": ratios(summaries),
        "requests": [{k: v for k, v in asdict(row).items() if k != "chunk_times"} | {"chunk_times_s": row.chunk_times}
                     for rows in rows_by_policy.values() for row in rows],
    }
    (output / "results.json").write_text(json.dumps(result, indent=1))
    labels = list(names.values())
    if summaries:
        print_table(summaries, labels)
    plots = plot(output, rows_by_policy, summaries, labels) if summaries else []
    for name, value in result["ratios"].items():
        console.print(f"{name}: {value if isinstance(value, str) else f'{value:.3f}'}", highlight=False)
    if any(s["foreign_cpu_cores"] > 0.3 for s in summaries.values()):
        console.print("[yellow]other processes loaded this machine during the run (cores, by policy): "
                      + ", ".join(f"{k} {v['foreign_cpu_cores']:.2f}" for k, v in summaries.items()) + "[/]")
    console.print(f"wrote {output / 'results.json'}" + (f" and {', '.join(plots)}" if plots else ""), highlight=False)
    return 1 if aborted else 0


if __name__ == "__main__":
    sys.exit(main())
