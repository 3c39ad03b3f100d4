"""Every policy's replay on one cluster, and the results both placement measurements write.

Per policy: empty every cache (``POST /admin/reset-cache``, ``ReplayServer.reset_cache``)
and wait until the index is empty too, so every policy starts cold; then replay the same
requests open loop on their arrival schedule, each with ``X-KVRoute-Policy: <policy>``
(``kvroute.bench.replay``). The CPU cores other processes used during each policy are
recorded (``foreign_cpu_cores``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvroute.bench.meters import ForeignLoad
from kvroute.bench.placement.cluster import (
    MODEL,
    START_TIMEOUT_S,
    Cluster,
    console,
    engine_record,
    wait_quiet,
    worker_labels,
)
from kvroute.bench.progress import track
from kvroute.bench.replay import POLICY_HEADER, REQUEST_TIMEOUT_S, ReplayTarget, Row
from kvroute.bench.replay_cli import replay_with_progress
from kvroute.bench.replay_report import ms, summary_table
from kvroute.bench.replay_results import ratios, row_dict, summarize
from kvroute.bench.replay_server import ReplayServer
from workloads import RepositoryAssistantConfig, repository_prefixes


@dataclass
class Runs:
    """Every policy's replay on one cluster, as far as it got."""

    all_rows: dict[str, list[Row]] = field(default_factory=dict)
    counted: dict[str, list[Row]] = field(default_factory=dict)  # the rows --warm-requests leaves in
    summaries: dict[str, dict] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # worker id -> label
    waited_for_quiet_s: float = 0.0
    aborted: str | None = None


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


def measure(cluster: Cluster, items: list, policies: list[str], warm_requests: int, wait_quiet_s: float,
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
        for policy in track(policies, "policies", console):
            reset = server.reset_cache(MODEL, warn)
            quiet = wait_quiet(wait_quiet_s)
            runs.waited_for_quiet_s += quiet
            time.sleep(1.0)
            console.print(f"[bold]{policy}[/]: replaying {len(items)} requests", highlight=False)
            load = ForeignLoad()
            rows, duration = replay_with_progress(target, policy, items, console)
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


def request_row(row: Row) -> dict:
    """A row as these measurements have always written it: the workload's group is its repository."""
    return {("repository" if k == "group" else k): v for k, v in row_dict(row).items()}


def run_record(args: argparse.Namespace, cluster: Cluster, runs: Runs, waited: float, kv_cache_gib: float,
               dtype: str) -> dict:
    """The parts of results.json every measurement of this kind writes; ``workload``: the
    workers' engine settings (``engine_record``), to which a measurement may add its own."""
    return {
        "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "kv_cache_gib_used": kv_cache_gib, "dtype": dtype, "cluster_command": cluster.args[1:]},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "waited_for_quiet_s": waited + runs.waited_for_quiet_s, "load_average_at_end": os.getloadavg()},
        "aborted": runs.aborted,
        "workers": runs.names,
        "summaries": runs.summaries,
        "ratios": ratios(runs.summaries),
        "requests": [{**request_row(row), "counted": row.index >= args.warm_requests}
                     for rows in runs.all_rows.values() for row in rows],
        "workload": engine_record(kv_cache_gib, dtype),
    }


def plot(output: Path, rows_by_policy: dict[str, list[Row]], summaries: dict[str, dict],
         labels: list[str]) -> None:
    from kvroute.bench import replay_plots  # matplotlib: only once there is something to plot

    replay_plots.ttft_cdf(rows_by_policy, output / "ttft_cdf.png")
    replay_plots.hit_rate_bars(summaries, output / "hit_rate.png")
    replay_plots.placement_bars(summaries, labels, output / "worker_load.png")


def report(output: Path, result: dict, runs: Runs, title: str) -> None:
    """Write results.json and the plots; print the table, the ratios and any foreign load."""
    (output / "results.json").write_text(json.dumps(result, indent=1))
    summaries, labels = runs.summaries, list(runs.names.values())
    if summaries:
        console.print(summary_table(summaries, labels, title))
        plot(output, runs.counted, summaries, labels)
    for name, value in result["ratios"].items():
        console.print(f"{name}: {value if isinstance(value, str) else f'{value:.3f}'}", highlight=False)
    if any(s["foreign_cpu_cores"] > 0.3 for s in summaries.values()):
        console.print("[yellow]other processes loaded this machine during the run (cores, by policy): "
                      + ", ".join(f"{k} {v['foreign_cpu_cores']:.2f}" for k, v in summaries.items()) + "[/]")
