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

    .venv/bin/python scripts/measure_placement.py [--output DIR] [--policies cache_aware,round_robin]
        [--requests N] [--rate R] [--repositories K] [--seed S] [--kv-cache-gib G]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the project is run from its checkout, not installed
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402
from rich.console import Console  # noqa: E402

from foundation.netutil import free_port  # noqa: E402
from kvroute.bench import replay_plots  # noqa: E402
from kvroute.bench.replay import POLICY_HEADER, REQUEST_TIMEOUT_S, ReplayTarget, Row, replay  # noqa: E402
from kvroute.bench.replay_report import ms, summary_table  # noqa: E402
from kvroute.bench.replay_results import ratios, row_dict, summarize  # noqa: E402
from kvroute.bench.replay_server import ReplayServer  # noqa: E402
from kvroute.bench.replay_sources import workload_item  # noqa: E402
from worker.block_size import CPU_BLOCK_SIZE  # noqa: E402
from worker.dtype import resolve_here  # noqa: E402
from worker.settings import WorkerSettings, default_long_prefill_tokens  # noqa: E402
from workloads import (  # noqa: E402
    RepositoryAssistantConfig,
    estimate_prefix_tokens,
    generate_workload,
    load_tokenizer,
    prompt_tokens,
    repository_prefixes,
    tokenizer_counter,
)

console = Console(width=170)  # the table is wide; also when the output goes to a file

ALL_POLICIES = ("cache_aware", "round_robin", "least_loaded", "prefix_affinity", "block_cost")
MODEL = "SmolLM2-135M-Instruct"
# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x K,V, times the dtype's bytes.
KV_ELEMENTS_PER_TOKEN = 30 * 3 * 64 * 2
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
PREFILL_WORKERS, DECODE_WORKERS = 2, 1
MAX_MODEL_LEN = 4096
START_TIMEOUT_S = 900


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("results/measure_placement"),
                        help="folder for results.json, plots and the cluster's log (default: %(default)s)")
    parser.add_argument("--policies", default=",".join(ALL_POLICIES),
                        help="comma-separated policies, run in this order (default: all five)")
    parser.add_argument("--requests", type=int, default=120, help="requests per policy (default: %(default)s)")
    parser.add_argument("--warm-requests", type=int, default=0,
                        help="leading requests of each policy's replay that are sent but left out of its "
                             "statistics, so they describe warm caches rather than each repository's first, "
                             "compulsory miss (default: %(default)s)")
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
    args.policies = checked_policies(parser, args.policies)
    return args


def checked_policies(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The comma-separated ``--policies``; unknown names or none end the script with a usage error."""
    policies = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in policies if p not in ALL_POLICIES]
    if unknown or not policies:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(ALL_POLICIES)}")
    return policies


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
        # A process group of its own (stopped as one), in this script's session: with the cluster
        # in a session of its own, the scheduler's autogroups shared the CPU between the cluster
        # and this client as two groups, and under load the client sent requests up to 11 s late
        # (results/measure_placement_s14, max_send_lateness_s; see foundation.launcher.spawn).
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            cwd=REPO_ROOT, process_group=0)

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


def progress_printer(policy: str, total: int):
    """A line every 25 finished requests and at the last."""
    started, done = time.monotonic(), 0

    def finished(_row: Row) -> None:
        nonlocal done
        done += 1
        if done % 25 == 0 or done == total:
            console.print(f"  {policy}: {done}/{total} done at {time.monotonic() - started:.0f} s", highlight=False)

    return finished


def request_row(row: Row) -> dict:
    """A row as this script has always written it: the workload's group is its repository."""
    return {("repository" if k == "group" else k): v for k, v in row_dict(row).items()}


def plot(output: Path, rows_by_policy: dict[str, list[Row]], summaries: dict[str, dict], labels: list[str]) -> list[str]:
    replay_plots.ttft_cdf(rows_by_policy, output / "ttft_cdf.png")
    replay_plots.hit_rate_bars(summaries, output / "hit_rate.png")
    replay_plots.placement_bars(summaries, labels, output / "worker_load.png")
    return ["ttft_cdf.png", "hit_rate.png", "worker_load.png"]


@dataclass
class Runs:
    """Every policy's replay on one cluster, as far as it got."""

    all_rows: dict[str, list[Row]] = field(default_factory=dict)
    counted: dict[str, list[Row]] = field(default_factory=dict)  # the rows --warm-requests leaves in
    summaries: dict[str, dict] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # worker id -> label
    waited_for_quiet_s: float = 0.0
    aborted: str | None = None


def measure(cluster: Cluster, items: list, policies: list[str], warm_requests: int, wait_quiet: float,
            warm: Callable[[Cluster], None]) -> Runs:
    """Replay ``items`` once per policy, caches emptied before each; the cluster is stopped at the end."""
    runs, started = Runs(), time.monotonic()
    try:
        startup_load = ForeignLoad()
        workers = cluster.wait_ready(START_TIMEOUT_S)
        console.print(f"cluster ready after {time.monotonic() - started:.0f} s (other processes used "
                      f"{startup_load.cores():.2f} cores meanwhile)", highlight=False)
        names = runs.names = worker_labels(workers, cluster.log_path.parent / "workers")
        console.print("workers: " + ", ".join(f"{label} = {wid}" for wid, label in names.items()), highlight=False)
        warm(cluster)
        server, target = ReplayServer(cluster.url), ReplayTarget(cluster.url, MODEL)
        warn = lambda message: console.print(f"[yellow]  {message}[/]", highlight=False)  # noqa: E731
        for policy in policies:
            reset = server.reset_cache(MODEL, warn)
            quiet = wait_for_quiet(wait_quiet) if wait_quiet > 0 else 0.0
            runs.waited_for_quiet_s += quiet
            time.sleep(1.0)
            console.print(f"[bold]{policy}[/]: replaying {len(items)} requests", highlight=False)
            load = ForeignLoad()
            rows, duration = asyncio.run(replay(target, policy, items, progress_printer(policy, len(items))))
            runs.all_rows[policy] = rows
            rows = runs.counted[policy] = [row for row in rows if row.index >= warm_requests]
            runs.summaries[policy] = s = {"policy": policy, "foreign_cpu_cores": load.cores(),
                                          "waited_for_quiet_s": quiet, **summarize(policy, rows, duration, names)}
            s["reset_ok"], s["reset_attempts"] = bool(reset.get("reset")), reset.get("attempts")
            s["index_blocks_at_start"] = {names.get(k, k): v for k, v in reset.get("index_blocks_at_start", {}).items()}
            s["index_blocks_right_after_reset"] = {names.get(k, k): v
                                                   for k, v in reset.get("index_blocks_after_reset", {}).items()}
            console.print(f"  hit rate {s['hit_rate'] or 0:.1%}, TTFT p50 {ms(s['ttft_p50_s'])} ms "
                          f"p99 {ms(s['ttft_p99_s'])} ms, errors {s['errors']}, slow hand-offs "
                          f"{s['slow_handoffs_over_5s']}, other processes {s['foreign_cpu_cores']:.2f} cores",
                          highlight=False)
            for row in rows:
                if row.error:
                    console.print(f"  [red]request {row.index}: {row.status} {row.error}[/]", highlight=False)
                    break
    except (Exception, KeyboardInterrupt) as error:
        runs.aborted = f"{type(error).__name__}: {error}"
        console.print(f"[red]aborted: {runs.aborted}[/]")
    finally:
        code = cluster.stop()
        console.print(f"cluster stopped (exit code {code}) after {time.monotonic() - started:.0f} s",
                      highlight=False)
    return runs


def run_record(args: argparse.Namespace, cluster: Cluster, runs: Runs, waited: float, **settings) -> dict:
    """The parts of results.json every measurement of this kind writes."""
    return {
        "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     **settings, "cluster_command": cluster.args[1:]},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "waited_for_quiet_s": waited + runs.waited_for_quiet_s, "load_average_at_end": os.getloadavg()},
        "aborted": runs.aborted,
        "workers": runs.names,
        "summaries": runs.summaries,
        "ratios": ratios(runs.summaries),
        "requests": [{**request_row(row), "counted": row.index >= args.warm_requests}
                     for rows in runs.all_rows.values() for row in rows],
    }


def kv_cache_tokens(kv_cache_gib: float, dtype: str) -> float:
    """Tokens of KV one worker's cache holds (before vLLM rounds down to whole blocks)."""
    return kv_cache_gib * 2**30 / (KV_ELEMENTS_PER_TOKEN * DTYPE_BYTES[dtype])


def engine_record(kv_cache_gib: float, dtype: str) -> dict:
    """The workers' engine settings a simulation of the run needs (``simulator.from_replay``):
    cache size, block size, per-request step caps and eviction order, as the workers start
    by default on CPU."""
    return {"kv_cache_tokens_per_worker": kv_cache_tokens(kv_cache_gib, dtype), "block_size": CPU_BLOCK_SIZE,
            "long_prefill_tokens": {role: default_long_prefill_tokens(role) for role in ("prefill", "decode")},
            "evict_pulled_first": WorkerSettings.evict_pulled_first}


def report(output: Path, result: dict, runs: Runs, title: str) -> None:
    """Write results.json and the plots; print the table, the ratios and any foreign load."""
    (output / "results.json").write_text(json.dumps(result, indent=1))
    summaries, labels = runs.summaries, list(runs.names.values())
    if summaries:
        console.print(summary_table(summaries, labels, title))
    plots = plot(output, runs.counted, summaries, labels) if summaries else []
    for name, value in result["ratios"].items():
        console.print(f"{name}: {value if isinstance(value, str) else f'{value:.3f}'}", highlight=False)
    if any(s["foreign_cpu_cores"] > 0.3 for s in summaries.values()):
        console.print("[yellow]other processes loaded this machine during the run (cores, by policy): "
                      + ", ".join(f"{k} {v['foreign_cpu_cores']:.2f}" for k, v in summaries.items()) + "[/]")
    console.print(f"wrote {output / 'results.json'}" + (f" and {', '.join(plots)}" if plots else ""), highlight=False)


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
    per_worker_tokens = kv_cache_tokens(kv_cache_gib, dtype)
    popularity = Counter(r.repository for r in workload)
    console.print(f"workload: {len(workload)} requests over {workload[-1].arrival_seconds:.0f} s, "
                  f"{config.repositories} repositories, prefixes {min(prefix_tokens)}-{max(prefix_tokens)} tokens, "
                  f"working set {working_set} tokens ({working_set * bytes_per_token / 2**30:.3f} GiB); "
                  f"KV cache per worker {kv_cache_gib:.3f} GiB = {per_worker_tokens:.0f} tokens "
                  f"({per_worker_tokens / working_set:.0%} of the working set)", highlight=False)

    waited = wait_for_quiet(args.wait_quiet) if args.wait_quiet > 0 else 0.0
    cluster = Cluster(args.port or free_port(), kv_cache_gib, dtype, output / "serve.log")
    console.print(f"cluster: {' '.join(cluster.args[1:])}", highlight=False)
    items = [workload_item(request) for request in workload]
    runs = measure(cluster, items, args.policies, args.warm_requests, args.wait_quiet,
                   lambda running: warm_up(running, config, count))
    result = run_record(args, cluster, runs, waited, kv_cache_gib_used=kv_cache_gib, dtype=dtype)
    result["workload"] = {
        "config": asdict(config), "prefix_tokens": prefix_tokens, "working_set_tokens": working_set,
        "longest_prompt_tokens": longest_prompt, "requests_per_repository": dict(sorted(popularity.items())),
        **engine_record(kv_cache_gib, dtype)}
    report(output, result, runs, "Placement policies, repository-assistant workload")
    return 1 if runs.aborted else 0


if __name__ == "__main__":
    sys.exit(main())
