"""The sweep: every system in turn, every workload and rate on it, the same requests for all.

::

    build every workload's requests at every rate (the same for every system)
    per system, in the order given (a system that cannot run is recorded as skipped, with why):
        start it (systems.running) ─▶ a few unmeasured warm-up requests
        per workload, per rate:  reset its caches ─▶ replay open loop ─▶ report.run_metrics
        stop it (also on an error or Ctrl-C, which ends the sweep with what was measured)

Requests go through kvroute's replay client (``replay.replay``) with no policy header; only
kvroute's rows get decision records (``ReplayTarget.fetch_decisions``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from kvroute.bench.peers import report, sources
from kvroute.bench.peers.plans import Plan
from kvroute.bench.peers.systems import RunningSystem, SystemStartError, running
from kvroute.bench.progress import track
from kvroute.bench.replay import ReplayItem, ReplayTarget, Row, replay
from kvroute.bench.replay_cli import replay_with_progress
from kvroute.bench.replay_server import ReplayError, ReplayServer
from kvroute.bench.replay_sources import WorkloadChoice, workload_items

WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts share nothing with the measured ones


@dataclass(frozen=True)
class Skipped:
    """A system that does not run here, and why (recorded in results.json and the table)."""

    system: str
    reason: str


@dataclass(frozen=True)
class SweepSettings:
    workloads: tuple[str, ...]
    rates: tuple[float, ...]
    source: sources.SourceSettings
    targets: report.Targets
    start_timeout_s: float = 900
    request_timeout_s: float = 600
    warmup_requests: int = 3


@dataclass
class RunRecord:
    system: str
    workload: str
    rate: float
    rows: list[Row]
    metrics: dict
    cache_reset: dict


@dataclass
class SystemRecord:
    system: str
    description: str = ""
    settings: dict = field(default_factory=dict)
    skipped: str | None = None
    start_s: float | None = None
    runs: list[RunRecord] = field(default_factory=list)


@dataclass
class Sweep:
    systems: list[SystemRecord] = field(default_factory=list)
    sources: dict = field(default_factory=dict)  # "workload@rate" → where the requests came from
    aborted: str | None = None

    def metrics(self) -> dict[str, dict[str, dict[float, dict]]]:
        """``[system][workload][rate]`` → run metrics, for ``report.comparisons``."""
        out: dict = {}
        for record in self.systems:
            for run in record.runs:
                out.setdefault(record.system, {}).setdefault(run.workload, {})[run.rate] = run.metrics
        return out


Workload = tuple[list[ReplayItem], dict, dict[int, int | None]]  # items, source, requested lengths


def build_workloads(settings: SweepSettings) -> dict[tuple[str, float], Workload]:
    built = {}
    for workload in settings.workloads:
        for rate in settings.rates:
            items, source = sources.items(workload, rate, settings.source)
            built[workload, rate] = (items, source, sources.requested_lengths(items))
    return built


def sweep(systems: list[Plan | Skipped], settings: SweepSettings, log_dir: Path, console: Console) -> Sweep:
    built = build_workloads(settings)
    result = Sweep(sources={f"{w}@{r:g}": {"requests": len(items), **source}
                            for (w, r), (items, source, _) in built.items()})
    for entry in track(systems, "systems", console, name=lambda entry: entry.system):
        if isinstance(entry, Skipped):
            console.print(f"[yellow]{entry.system}: skipped: {entry.reason}[/]", highlight=False)
            result.systems.append(SystemRecord(entry.system, skipped=entry.reason))
            continue
        record = SystemRecord(entry.system, entry.description, entry.settings)
        result.systems.append(record)
        try:
            measure_system(entry, built, settings, log_dir, console, record)
        except (SystemStartError, ReplayError) as error:
            record.skipped = f"did not run: {error}"
            console.print(f"[red]{entry.system}: {record.skipped}[/]", highlight=False)
        except KeyboardInterrupt:
            console.print("[red]interrupted; every process stopped, writing what was measured[/]")
            result.aborted = "interrupted"
            break
    return result


def measure_system(plan: Plan, built: dict[tuple[str, float], Workload], settings: SweepSettings,
                   log_dir: Path, console: Console, record: SystemRecord) -> None:
    console.print(f"[bold]{plan.system}[/]: starting {plan.description}", highlight=False)
    started = time.monotonic()
    with running(plan, log_dir, settings.start_timeout_s) as system:
        record.start_s = time.monotonic() - started
        target = _target(system, settings.request_timeout_s)
        console.print(f"  ready in {record.start_s:.0f} s at {system.url}", highlight=False)
        warm_up(target, settings, plan.system)
        for (workload, rate), (items, _, lengths) in track(built.items(), "workloads and rates", console,
                                                            name=lambda run: f"{run[0][0]} @{run[0][1]:g}/s"):
            record.runs.append(measure_run(system, target, workload, rate, items, lengths, settings, console))


def measure_run(system: RunningSystem, target: ReplayTarget, workload: str, rate: float, items: list[ReplayItem],
                lengths: dict[int, int | None], settings: SweepSettings, console: Console) -> RunRecord:
    name = system.plan.system
    reset = system.reset_cache(target.model, lambda message: console.print(f"[yellow]  {message}[/]"))
    rows, duration = replay_with_progress(target, f"{name} {workload} @{rate:g}/s", items, console)
    metrics = report.run_metrics(rows, duration, settings.targets, lengths)
    if name == "router-kv_aware":
        metrics["router_kv_index"] = report.kv_aware_credits(_read_all(system.front_logs()))
    console.print(f"  {workload} @{rate:g}/s: {metrics['succeeded']}/{metrics['requests']} ok, "
                  f"TTFT p50 {report.fmt(metrics['ttft_p50_s'], 's')}, "
                  f"TPOT p50 {report.fmt(metrics['tpot_p50_s'], 's')}, "
                  f"hit rate {report.fmt(metrics['hit_rate'], '%')}, SLO met {metrics['slo_attainment']:.0%}",
                  highlight=False)
    return RunRecord(name, workload, rate, rows, metrics, reset)


def _target(system: RunningSystem, request_timeout_s: float) -> ReplayTarget:
    server = ReplayServer(system.url)
    try:
        model = server.model_name()
    finally:
        server.close()
    return ReplayTarget(system.url, model, request_timeout_s=request_timeout_s, choose_policy=False,
                        fetch_decisions=system.plan.kvroute_api)


def warm_up(target: ReplayTarget, settings: SweepSettings, label: str,
            send: Callable = replay) -> None:
    """Unmeasured requests, so no run pays for the engines' first, cold code paths."""
    if settings.warmup_requests < 1:
        return
    choice = WorkloadChoice(requests=settings.warmup_requests, rate=2.0,
                            seed=settings.source.seed + WARMUP_SEED_OFFSET)
    asyncio.run(send(target, f"{label} warm-up", workload_items("no-sharing", choice)))


def _read_all(paths: list[Path]) -> str:
    return "".join(path.read_text(errors="replace") for path in paths if path.exists())
