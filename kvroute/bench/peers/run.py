"""The sweep: every workload and rate on every system, the same requests for all.

Interleaved (the default)::

    build every workload's requests at every rate (the same for every system)
    start every system (systems.running), one after another, each warmed up with a few
        unmeasured requests; all stay up, idle while another is measured
    per workload, per rate, ``repeats`` times:
        per system, in the order given, reversed every other run (A B C, C B A, ...):
            reset its caches ─▶ replay open loop
    per system, workload and rate: report.run_metrics over the rows of all its repeats
    stop every system (also on an error or Ctrl-C, which ends the sweep with what was measured)

Why interleaved: on a shared machine the speed of the same engine drifts by tens of percent
over minutes (measured here: one vLLM server's TPOT went from 85 to 65 ms over six rounds of
the same requests), so systems measured one after another differ by the drift as much as by
what they do; alternated run by run, with the order reversed every other run, each system
sees the same drift. ``sequential`` starts one system at a time instead (each stopped before
the next starts), for a machine without the memory to hold them all at once.

Requests go through kvroute's replay client (``replay.replay``) with no policy header; only
kvroute's rows get decision records (``ReplayTarget.fetch_decisions``).
"""

from __future__ import annotations

import asyncio
import contextlib
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
    sequential: bool = False  # one system at a time instead of alternated run by run
    repeats: int = 1  # runs per system, workload and rate; the metrics are over all of them

    def __post_init__(self):
        if self.repeats < 1:
            raise ValueError("repeats must be at least 1")


@dataclass
class RunRecord:
    """One system's ``repeats`` runs of one workload at one rate: every row, metrics over all."""

    system: str
    workload: str
    rate: float
    rows: list[Row]
    metrics: dict
    cache_reset: dict  # the first run's; ``repeats`` says how many runs the rows came from
    repeats: int = 1
    # Each run's own metrics, in order: the k-th run of every system shared the k-th round.
    by_repeat: tuple[dict, ...] = ()


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
        return self._per_run(lambda run: run.metrics)

    def metrics_by_round(self) -> dict[str, dict[str, dict[float, tuple[dict, ...]]]]:
        """``[system][workload][rate]`` → each run's metrics, round by round, for ``report.comparisons``."""
        return self._per_run(lambda run: run.by_repeat)

    def _per_run(self, value) -> dict:
        out: dict = {}
        for record in self.systems:
            for run in record.runs:
                out.setdefault(record.system, {}).setdefault(run.workload, {})[run.rate] = value(run)
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
    runnable: list[tuple[Plan, SystemRecord]] = []
    for entry in systems:
        if isinstance(entry, Skipped):
            console.print(f"[yellow]{entry.system}: skipped: {entry.reason}[/]", highlight=False)
            result.systems.append(SystemRecord(entry.system, skipped=entry.reason))
            continue
        record = SystemRecord(entry.system, entry.description, entry.settings)
        result.systems.append(record)
        runnable.append((entry, record))
    try:
        if settings.sequential:
            for plan, record in track(runnable, "systems", console, name=lambda entry: entry[0].system):
                measure_systems([(plan, record)], built, settings, log_dir, console)
        else:
            measure_systems(runnable, built, settings, log_dir, console)
    except KeyboardInterrupt:
        console.print("[red]interrupted; every process stopped, writing what was measured[/]")
        result.aborted = "interrupted"
    return result


@dataclass
class _Live:
    """A started system in a sweep, and what its runs gathered so far."""

    record: SystemRecord
    system: RunningSystem
    target: ReplayTarget
    gathered: dict[tuple[str, float], RunRecord] = field(default_factory=dict)


def measure_systems(entries: list[tuple[Plan, SystemRecord]], built: dict[tuple[str, float], Workload],
                       settings: SweepSettings, log_dir: Path, console: Console) -> None:
    """Start every system of ``entries`` and keep them up, then run each workload and rate
    ``settings.repeats`` times on each, alternating the systems' order run by run. A system
    that does not start, or whose replay breaks, is recorded as not run (with why) and left out
    of the runs that follow; the others go on."""
    with contextlib.ExitStack() as stack:
        started: list[_Live] = []
        for plan, record in entries:
            try:
                started.append(_start(plan, record, stack, settings, log_dir, console))
            except (SystemStartError, ReplayError) as error:
                _did_not_run(record, error, console)
        live = list(started)
        runs = [(key, workload) for key, workload in built.items() for _ in range(settings.repeats)]
        try:
            for n, ((workload, rate), (items, _, lengths)) in enumerate(
                    track(runs, "workloads and rates", console, name=lambda run: f"{run[0][0]} @{run[0][1]:g}/s")):
                for entry in list(live if n % 2 == 0 else reversed(live)):
                    try:
                        run = measure_run(entry.system, entry.target, workload, rate, items, lengths, settings,
                                          console)
                    except ReplayError as error:
                        _did_not_run(entry.record, error, console, "stopped running" if entry.gathered else "")
                        live.remove(entry)
                        continue
                    _gather(entry, run, lengths, settings)
        finally:  # also on Ctrl-C, and for a system whose replay broke later: what was measured is kept
            for entry in started:
                entry.record.runs.extend(entry.gathered.values())


def _start(plan: Plan, record: SystemRecord, stack: contextlib.ExitStack, settings: SweepSettings,
           log_dir: Path, console: Console) -> _Live:
    console.print(f"[bold]{plan.system}[/]: starting {plan.description}", highlight=False)
    started = time.monotonic()
    system = stack.enter_context(running(plan, log_dir, settings.start_timeout_s))
    record.start_s = time.monotonic() - started
    target = _target(system, settings.request_timeout_s)
    console.print(f"  ready in {record.start_s:.0f} s at {system.url}", highlight=False)
    warm_up(target, settings, plan.system)
    return _Live(record, system, target)


def _did_not_run(record: SystemRecord, error: Exception, console: Console, what: str = "") -> None:
    record.skipped = f"{what or 'did not run'}: {error}"
    console.print(f"[red]{record.system}: {record.skipped}[/]", highlight=False)


def _gather(entry: _Live, run: RunRecord, lengths: dict[int, int | None], settings: SweepSettings) -> None:
    """Add a repeat's rows to the system's record of that workload and rate."""
    key = (run.workload, run.rate)
    earlier = entry.gathered.get(key)
    if earlier is None:
        entry.gathered[key] = run
        return
    rows = earlier.rows + run.rows
    duration = earlier.metrics["duration_s"] + run.metrics["duration_s"]
    # Over every row; what a run adds beyond run_metrics (router_kv_index) is the latest run's.
    metrics = {**run.metrics, **report.run_metrics(rows, duration, settings.targets, lengths)}
    entry.gathered[key] = RunRecord(run.system, run.workload, run.rate, rows, metrics, earlier.cache_reset,
                                    earlier.repeats + 1, earlier.by_repeat + run.by_repeat)


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
    return RunRecord(name, workload, rate, rows, metrics, reset, by_repeat=(metrics,))


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
