"""What every run of the results page shares (``Setup``): cost curves, the repository-assistant
base and both clusters' settings, from the simulator's defaults, a real run or an earlier page."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from kvroute.bench.simulation.real_run import load_real
from simulator import CpuSettings, EngineConfig, SimCalibration, SimulationSettings
from simulator.from_replay import calibration_from_replay, cluster_from_replay
from simulator.requests import replay_requests
from simulator.sequence import ceil_div
from worker.settings import WorkerSettings
from workloads import RepositoryAssistantConfig, generate_workload, prefix_target_tokens

# kvroute bench placement's default workload (2 prefill workers) and cache rule: 40% of the
# prefix working set plus one longest prompt and its output, per engine.
DEFAULT_REPOSITORY = RepositoryAssistantConfig(repositories=12, requests=120, rate=0.9, prefix_min_tokens=700,
                                               prefix_max_tokens=1400)
DEFAULT_REFERENCE_PREFILL, CACHE_FRACTION = 2, 0.4


@dataclass(frozen=True)
class Setup:
    """What every run shares: cost curves, the repository-assistant base, both clusters' settings."""

    calibration: SimCalibration
    calibration_source: str
    repository: RepositoryAssistantConfig  # made for reference_prefill prefill workers
    reference_prefill: int
    repository_settings: SimulationSettings
    trace_settings: SimulationSettings
    model: str  # how views and blocks are modelled, in words


def make_setup(real: Path | None) -> Setup:
    if real is None:
        engine = default_engine(DEFAULT_REPOSITORY)
        trace_engine = EngineConfig(evict_pulled_first=WorkerSettings.evict_pulled_first)
        return Setup(SimCalibration(), "the simulator's default curves (SimCalibration)", DEFAULT_REPOSITORY,
                     DEFAULT_REFERENCE_PREFILL, SimulationSettings(prefill_engine=engine, decode_engine=engine),
                     SimulationSettings(prefill_engine=trace_engine, decode_engine=trace_engine),
                     "exact views, blocks freed when a request ends (simulator defaults); a decode worker's "
                     "pulled prompts evicted first, as kvroute's workers do by default")
    results, decisions, _ = load_real(real)
    cluster = cluster_from_replay(results, decisions)
    trace_engine = replace(EngineConfig(), hold_sent_blocks=cluster.engine.hold_sent_blocks,
                           evict_pulled_first=cluster.engine.evict_pulled_first)
    return Setup(replace(calibration_from_replay(results, decisions), step_jitter=0.0),
                 f"fitted to the real run {real} (simulator.from_replay), jitter-free",
                 RepositoryAssistantConfig(**results["workload"]["config"]), cluster.num_prefill,
                 cluster.settings(cpu=CpuSettings()),
                 cluster.settings(cpu=CpuSettings(), prefill_engine=trace_engine, decode_engine=trace_engine),
                 "as validated: load reported once per step, a sent prefill's blocks held for a step"
                 + ("; a decode worker's pulled prompts evicted first, as in that run"
                    if cluster.engine.evict_pulled_first else ""))


def setup_from_page(page: Path) -> tuple[Setup, dict | None]:
    """What an earlier page recorded, and its real-cluster section. Engine settings it did
    not record (it predates them) take kvroute's current worker defaults, and the page says so."""
    report = json.loads(page.read_text())
    defaults = {"evict_pulled_first": WorkerSettings.evict_pulled_first}
    added = sorted(set(defaults) - set(report["trace_engine"]))

    def engine(name: str, fallback: str | None = None) -> EngineConfig:
        recorded = report.get(name) or report[fallback]  # pages before the decode engine was recorded: as prefill's
        return EngineConfig(**{k: v for k, v in defaults.items() if k in added} | recorded)

    # Pages from a real run model per-step load reports; pages from before this was recorded say so by "real".
    at_step_end = report.get("stats_at_step_end", report["real"] is not None)
    settings = {
        "repository": SimulationSettings(prefill_engine=engine("repository_engine"),
                                         decode_engine=engine("repository_decode_engine", "repository_engine"),
                                         cpu=CpuSettings(), stats_at_step_end=at_step_end),
        "trace": SimulationSettings(prefill_engine=engine("trace_engine"), decode_engine=engine("trace_engine"),
                                    cpu=CpuSettings(), stats_at_step_end=at_step_end)}
    model = report["model"] + "".join(f"; {name} = {defaults[name]} (kvroute's default now; not recorded by "
                                      f"{page})" for name in added)
    setup = Setup(SimCalibration.from_dict(report["calibration"]),
                  f"{report['calibration_source']}, as recorded by {page}",
                  RepositoryAssistantConfig(**report["repository_base"]), report["reference_prefill"],
                  settings["repository"], settings["trace"], model)
    return setup, carried_real(report, page)


def carried_real(report: dict, page: Path) -> dict:
    """A page's real-cluster sections, marked as carried from it."""
    return {name: report.get(name) and {"recorded_by": str(page)} | report[name]
            for name in ("real", "real_trace")}


def default_engine(config: RepositoryAssistantConfig) -> EngineConfig:
    """``kvroute bench placement``'s cache rule, on the drawn prefix lengths of the reference workload."""
    working_set = sum(prefix_target_tokens(config, r) for r in range(config.repositories))
    longest = max(r.prompt_tokens for r in replay_requests(generate_workload(config)))
    tokens = CACHE_FRACTION * working_set + longest + config.max_tokens
    return EngineConfig(num_blocks=ceil_div(int(tokens), EngineConfig().block_size),
                        evict_pulled_first=WorkerSettings.evict_pulled_first)
