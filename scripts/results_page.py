"""The results page: every placement policy on 2, 8, 64 and 1,000 simulated workers.

Each policy runs on 1 + 1, 4 + 4, 32 + 32 and 500 + 500 prefill + decode workers in the
simulator (``simulator``: the production planner and index, unchanged), each engine on
cores of its own (no CPU contention), on two workloads:

* **repository-assistant**, scaled with ``simulator.scaling.scale_repository_assistant``
  (as ``validate_simulator.py --scale`` does): repositories and rate in proportion to the
  prefill workers, the KV cache per engine unchanged, so every size has the same load
  and cache pressure per worker; ``REQUESTS_PER_PREFILL`` requests per prefill worker,
  at most ``MAX_REQUESTS`` (a size over the cap gets fewer per repository: the page says so);
* **the trace** (shared/data's Mooncake synthetic trace, scaled as ``simulate.py`` does),
  with a time scale per size from ``simulator.scaling.trace_time_scale``: the same
  cold-prefill load per prefill worker at every size.

Beside each: the reuse bounds of ``simulate.py`` (unlimited cache; one shared LRU cache
of all workers' blocks with perfect routing). Cost curves and workload base: with
``--real``, the curves fitted to that ``measure_placement`` run (``simulator.from_replay``),
its workload config and engine cache, its model of per-step load reports and held
blocks, and the validation table of ``validate_simulator.py``; with ``--from-page``, what an
earlier page recorded (its curves, workload base, engines and real-cluster section), to
redo the simulated part after a change to kvroute without a new real replay (engine
settings that page did not record take the workers' current defaults); else the
``SimCalibration`` defaults and ``measure_placement``'s default workload with a cache sized
by its rule.

Real-cluster sections: the repository-assistant run of ``--real`` (or the one the page of
``--from-page`` carries) and the trace run of ``--real-trace`` (a ``measure_trace.py``
``results.json``; or the page's), each with the targets and ``validate_simulator.py``'s
table of the simulator on the same requests. ``--from-page P --keep-simulated`` keeps P's
simulated part (its tables and plots, as P's command made them) and redoes only the
real-cluster sections: for adding a real run without the ~50 minutes of simulation.

Output (``--output``, default docs/results): ``RESULTS.md``, ``results.json`` (every number
on the page) and PNG plots. ``--quick``: a smoke run (sizes 2 and 8, few requests).

Usage::

    .venv/bin/python scripts/results_page.py [--output docs/results]
        [--real results/measure_placement/results.json | --from-page docs/results/results.json [--keep-simulated]]
        [--real-trace results/measure_trace/results.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

REPO_ROOT = Path(__file__).resolve().parent.parent
for path in (REPO_ROOT, REPO_ROOT / "scripts"):  # run from the checkout; the sibling scripts are shared
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import validate_simulator  # noqa: E402
from simulate import DEFAULT_TRACE, bounds  # noqa: E402

from kvroute.bench.replay_plots import _save as save_figure  # noqa: E402 (same style, same DPI)
from kvroute.bench.replay_plots import ttft_cdf
from kvroute.bench.replay_results import ratios  # noqa: E402
from orchestrator.planner.policies import POLICIES  # noqa: E402
from simulator import CpuSettings, EngineConfig, SimCalibration, SimulationSettings, simulate  # noqa: E402
from simulator.from_replay import calibration_from_replay, cluster_from_replay  # noqa: E402
from simulator.requests import replay_requests  # noqa: E402
from simulator.scaling import cold_prefill_seconds, scale_repository_assistant, trace_time_scale  # noqa: E402
from simulator.sequence import ceil_div  # noqa: E402
from worker.settings import WorkerSettings  # noqa: E402
from workloads import RepositoryAssistantConfig, generate_workload, prefix_target_tokens  # noqa: E402
from workloads.trace import TraceScaling, read_trace, scale_trace  # noqa: E402

SIZES, QUICK_SIZES = (1, 4, 32, 500), (1, 4)  # prefill workers; as many decode workers
REQUESTS_PER_PREFILL, MAX_REQUESTS = 100, 50_000
QUICK_REQUESTS_PER_PREFILL, QUICK_TRACE_RECORDS = 10, 100
CDF_WORKERS = 8
REPOSITORY, TRACE = "repository-assistant", "trace"
# measure_placement.py's default workload (2 prefill workers) and cache rule: 40% of the
# prefix working set plus one longest prompt and its output, per engine.
DEFAULT_REPOSITORY = RepositoryAssistantConfig(repositories=12, requests=120, rate=0.9, prefix_min_tokens=700,
                                               prefix_max_tokens=1400)
DEFAULT_REFERENCE_PREFILL, CACHE_FRACTION = 2, 0.4
FIGSIZE = (7.5, 25 / 6)  # 900 x 500 pixels at replay_plots' 120 DPI


@dataclass(frozen=True)
class Target:
    workload: str
    name: str
    key: str  # a field of a size's row
    bound: float
    at_least: bool  # True: value >= bound passes; False: value <= bound
    kind: str = "x"  # how the page shows the value: a ratio ("x") or a share ("%")

    def judge(self, row: dict) -> dict:
        value = row.get(self.key)
        passed = value is not None and (value >= self.bound if self.at_least else value <= self.bound)
        return {"target": self.name, "value": value, "bound": self.bound, "pass": passed, "kind": self.kind}


TARGETS = (
    Target(REPOSITORY, "cache_aware/round_robin P50 TTFT <= 0.25", "p50_ratio", 0.25, False),
    Target(REPOSITORY, "cache_aware/best baseline P99 TTFT <= 1", "p99_ratio", 1.0, False),
    Target(TRACE, "cache_aware reused tokens >= 90% of the shared LRU's", "of_lru", 0.9, True, "%"),
    Target(TRACE, "(stricter reading) >= 90% of the unlimited bound's", "of_unlimited", 0.9, True, "%"),
    Target(TRACE, "cache_aware/round_robin P50 TTFT <= 0.8", "p50_ratio", 0.8, False),
    Target(TRACE, "cache_aware/best baseline P99 TTFT <= 1", "p99_ratio", 1.0, False),
)


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "docs" / "results")
    parser.add_argument("--real", type=Path,
                        help="results.json of scripts/measure_placement.py: the simulation's cost curves and "
                             "workload base, and the real-cluster section (with --keep-simulated: that section alone)")
    parser.add_argument("--from-page", type=Path,
                        help="results.json of an earlier page: its curves, workload base, engines and "
                             "real-cluster sections, without a new replay")
    parser.add_argument("--real-trace", type=Path, help="results.json of scripts/measure_trace.py")
    parser.add_argument("--keep-simulated", action="store_true",
                        help="with --from-page: keep that page's simulated part, redo only the real-cluster sections")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--quick", action="store_true", help="sizes 2 and 8, few requests: a smoke run")
    args = parser.parse_args(argv)
    if args.keep_simulated and not args.from_page:
        parser.error("--keep-simulated keeps the simulated part of the page given by --from-page")
    if args.real and args.from_page and not args.keep_simulated:
        parser.error("--real and --from-page both give the simulation's cost curves; add --keep-simulated to "
                     "keep the page's simulation and take only the real-cluster section from --real")
    return args


def make_setup(real: Path | None) -> Setup:
    if real is None:
        engine = default_engine(DEFAULT_REPOSITORY)
        trace_engine = EngineConfig(evict_pulled_first=WorkerSettings.evict_pulled_first)
        return Setup(SimCalibration(), "the simulator's default curves (SimCalibration)", DEFAULT_REPOSITORY,
                     DEFAULT_REFERENCE_PREFILL, SimulationSettings(prefill_engine=engine, decode_engine=engine),
                     SimulationSettings(prefill_engine=trace_engine, decode_engine=trace_engine),
                     "exact views, blocks freed when a request ends (simulator defaults); a decode worker's "
                     "pulled prompts evicted first, as kvroute's workers do by default")
    results, decisions, _ = validate_simulator.load_real(real)
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
    """measure_placement's cache rule, on the drawn prefix lengths of the reference workload."""
    working_set = sum(prefix_target_tokens(config, r) for r in range(config.repositories))
    longest = max(r.prompt_tokens for r in replay_requests(generate_workload(config)))
    tokens = CACHE_FRACTION * working_set + longest + config.max_tokens
    return EngineConfig(num_blocks=ceil_div(int(tokens), EngineConfig().block_size),
                        evict_pulled_first=WorkerSettings.evict_pulled_first)


# ---------------------------------------------------------------- running


def run_size(source, num_prefill: int, settings: SimulationSettings, calibration: SimCalibration) -> tuple[dict, dict]:
    """Every policy on ``num_prefill`` + ``num_prefill`` workers: the size's row, and TTFTs by policy."""
    engine = settings.prefill_engine
    oracle = bounds(source, SimpleNamespace(block_size=engine.block_size, kv_blocks=engine.num_blocks,
                                            prefill=num_prefill, decode=num_prefill))
    policies, ttfts = {}, {}
    for policy in POLICIES:
        result = simulate(source, policy, num_prefill, num_prefill, calibration, 0, settings)
        s = result.summary
        policies[policy] = {"ttft_p50_s": s.ttft_p50, "ttft_p99_s": s.ttft_p99, "hit_rate": s.hit_rate,
                            "cached_tokens": s.cached_tokens, "finished": s.finished, "rejected": s.rejected,
                            "of_lru": share(s.cached_tokens, oracle["lru_all_workers"]["reused_tokens"]),
                            "of_unlimited": share(s.cached_tokens, oracle["unlimited"]["reused_tokens"]),
                            "of_prefill_lru": share(s.cached_tokens, oracle["lru_prefill_pool"]["reused_tokens"]),
                            "wall_seconds": result.wall_seconds}
        ttfts[policy] = [r.ttft_seconds for r in result.records if r.ttft_seconds is not None]
        print(f"  {2 * num_prefill} workers, {policy}: {result.wall_seconds:.1f} s", flush=True)
    row = {"workers": 2 * num_prefill, "num_prefill": num_prefill, "num_decode": num_prefill, "oracle": oracle,
           "policies": policies, "wall_seconds": sum(p["wall_seconds"] for p in policies.values())}
    return row | summary_ratios(policies), ttfts


def share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def summary_ratios(policies: dict[str, dict]) -> dict:
    return target_ratios(ratios(policies)) | {"of_lru": policies["cache_aware"]["of_lru"],
                                              "of_unlimited": policies["cache_aware"]["of_unlimited"]}


def target_ratios(found: dict) -> dict:
    """``replay_results.ratios`` under the names the targets judge."""
    return {"p50_ratio": found.get("cache_aware_over_round_robin_p50_ttft"),
            "p99_ratio": found.get("cache_aware_over_best_baseline_p99_ttft"),
            "best_baseline_p99": found.get("best_baseline_p99_ttft")}


def repository_runs(setup: Setup, sizes, per_prefill: int) -> tuple[list[dict], dict]:
    rows, cdf = [], {}
    for num_prefill in sizes:
        requests = min(per_prefill * num_prefill, MAX_REQUESTS)
        config = scale_repository_assistant(setup.repository, setup.reference_prefill, num_prefill, requests)
        workload = replay_requests(generate_workload(config))  # token ids once, for the oracle and every policy
        row, ttfts = run_size(workload, num_prefill, setup.repository_settings, setup.calibration)
        rows.append(row | {"requests": requests, "workload": asdict(config),
                           "requests_per_repository": requests / config.repositories,
                           "cold_prefill_load": cold_load(workload, num_prefill, setup.calibration)})
        cdf = ttfts if row["workers"] == CDF_WORKERS else cdf
    return rows, cdf


def trace_runs(setup: Setup, path: Path, sizes, limit: int | None) -> tuple[list[dict], dict]:
    records = read_trace(path, limit)
    prompts = [r.prompt_tokens for r in scale_trace(records).requests]
    rows, cdf = [], {}
    for num_prefill in sizes:
        scale = trace_time_scale(prompts, num_prefill, setup.calibration)
        trace = scale_trace(records, TraceScaling(time_scale=scale))
        row, ttfts = run_size(trace, num_prefill, setup.trace_settings, setup.calibration)
        rows.append(row | {"requests": trace.kept, "dropped": trace.dropped, "time_scale": scale,
                           "trace_seconds": trace.requests[-1].arrival_seconds,
                           "cold_prefill_load": cold_load(trace.requests, num_prefill, setup.calibration)})
        cdf = ttfts if row["workers"] == CDF_WORKERS else cdf
    return rows, cdf


def cold_load(requests, num_prefill: int, calibration: SimCalibration) -> float:
    """Prefill seconds per second per prefill worker, were nothing ever cached."""
    span = max(r.arrival_seconds for r in requests)
    return cold_prefill_seconds((r.prompt_tokens for r in requests), calibration) / (num_prefill * span)


def judge_targets(workloads: dict[str, list[dict]]) -> None:
    for workload, rows in workloads.items():
        for row in rows:
            row["targets"] = [target.judge(row) for target in TARGETS if target.workload == workload]


def validation(real: Path) -> dict:
    """The real run's summaries and validate_simulator's model table (simulated vs real);
    a trace run's sample, bounds and targets."""
    args = validate_simulator.parse_args(["--real", str(real)])
    results, decisions, _ = validate_simulator.load_real(real)
    out = {"source": str(real), "summaries": results["summaries"], "ratios": results["ratios"],
           "workers": results["workers"]}
    if validate_simulator.is_trace_run(results):
        out |= {"trace": results["trace"] | {"family_fraction": results["settings"]["family_fraction"]},
                "targets": real_targets(TRACE, results["summaries"], results["ratios"])}
    else:
        out |= {"workload": results["workload"]["config"],
                "targets": real_targets(REPOSITORY, results["summaries"], results["ratios"])}
    try:
        requests, check = validate_simulator.rebuild_requests(results)  # needs the model's tokenizer
    except (ImportError, OSError) as error:
        return out | {"validation_error": f"{type(error).__name__}: {error}"}
    cluster = cluster_from_replay(results, decisions)
    simulated = validate_simulator.simulate_all(requests, list(results["summaries"]), cluster,
                                                calibration_from_replay(results, decisions), cluster.settings(),
                                                args.seeds)
    return out | {"request_check": check, "band": args.band, "seeds": args.seeds,
                  "comparison": validate_simulator.compare(results, simulated, args.band)}


def real_targets(workload: str, summaries: dict[str, dict], found: dict) -> list[dict]:
    """A workload's targets judged on a real run (a trace run's summaries carry the shares of the bounds)."""
    cache_aware = summaries.get("cache_aware", {})
    row = target_ratios(found) | {"of_lru": cache_aware.get("of_lru_all_workers"),
                                  "of_unlimited": cache_aware.get("of_unlimited")}
    return [target.judge(row) for target in TARGETS if target.workload == workload]


# ---------------------------------------------------------------- plots


def plot_ttft(rows: list[dict], title: str, path: Path) -> Path:
    figure, axes = plt.subplots(1, 2, figsize=FIGSIZE, sharey=True)
    workers = [row["workers"] for row in rows]
    for axis, (key, label) in zip(axes, (("ttft_p50_s", "P50"), ("ttft_p99_s", "P99"))):
        for policy in POLICIES:
            axis.plot(workers, [row["policies"][policy][key] for row in rows], marker="o", label=policy)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xticks(workers, [str(w) for w in workers])
        axis.set_xlabel("workers (prefill + decode, log scale)")
        axis.set_title(f"{label} TTFT")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("seconds (log scale)")
    axes[0].legend(fontsize="small")
    figure.suptitle(title)
    return save_figure(figure, path)


def plot_hit_rate(rows: list[dict], title: str, path: Path) -> Path:
    figure, axis = plt.subplots(figsize=FIGSIZE)
    workers = [row["workers"] for row in rows]
    for policy in POLICIES:
        axis.plot(workers, [100 * row["policies"][policy]["hit_rate"] for row in rows], marker="o", label=policy)
    for key, label, style in (("lru_all_workers", "shared LRU, perfect routing", "--"),
                              ("unlimited", "unlimited cache", ":")):
        axis.plot(workers, [100 * row["oracle"][key]["hit_rate"] for row in rows], style, color="black", label=label)
    axis.set_xscale("log")
    axis.set_xticks(workers, [str(w) for w in workers])
    axis.set_xlabel("workers (prefill + decode, log scale)")
    axis.set_ylabel("cached / prompt tokens (%)")
    axis.set_ylim(0, 100)
    axis.set_title(title)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the lines, not on them
    return save_figure(figure, path)


def plot_cdf(ttfts: dict[str, list[float]], path: Path) -> Path:
    """``replay_plots.ttft_cdf`` over simulated TTFTs (it reads ``ttft_s`` and ``succeeded``)."""
    rows = {policy: [SimpleNamespace(ttft_s=t, succeeded=True) for t in values] for policy, values in ttfts.items()}
    return ttft_cdf(rows, path)


def write_plots(workloads: dict[str, list[dict]], cdfs: dict[str, dict], output: Path) -> dict[str, list[str]]:
    plots = {}
    for workload, rows in workloads.items():
        slug = workload.replace("-", "_")
        files = [plot_ttft(rows, f"{workload}: TTFT per policy vs cluster size", output / f"{slug}_ttft.png"),
                 plot_hit_rate(rows, f"{workload}: prefix-cache hit rate vs cluster size",
                               output / f"{slug}_hit_rate.png")]
        if cdfs.get(workload):
            files.append(plot_cdf(cdfs[workload], output / f"{slug}_ttft_cdf_{CDF_WORKERS}.png"))
        plots[workload] = [f.name for f in files]
    return plots


# ---------------------------------------------------------------- the page


def cell(value, kind: str = "s") -> str:
    """Seconds and ratios to two decimals ("s", "x"), shares as percentages ("%")."""
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if kind == "%" else f"{value:.2f}"


def listing(items: list[str]) -> str:
    return " and ".join(filter(None, [", ".join(items[:-1]), items[-1]])) if items else ""


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(item) for item in row) + " |" for row in rows])


def verdict(judged: dict) -> str:
    return f"{cell(judged['value'], judged['kind'])} {'PASS' if judged['pass'] else 'MISS'}"


def curves(c: dict) -> str:
    return (f"prefill {c['prefill_fixed_seconds']:.3f} s + {1000 * c['prefill_per_token_seconds']:.2f} ms a token + "
            f"{c['prefill_attention_seconds']:.2g} s per attended position; decode step "
            f"{1000 * c['decode_step_fixed_seconds']:.0f} ms + {1000 * c['decode_per_sequence_seconds']:.1f} ms per "
            f"sequence; link {1000 * c['link_latency_seconds']:.0f} ms + "
            f"{c['link_bandwidth_bytes_per_second'] / 1e9:.2f} GB/s; {c['bytes_per_token']:,} bytes of KV a token")


def header_section(report: dict) -> str:
    quick = "\n\n**Quick run** (`--quick`): a smoke test with few requests; not results." if report["quick"] else ""
    sizes = ", ".join(f"{r['num_prefill']} + {r['num_decode']}" for r in report["workloads"][REPOSITORY])
    return f"""# Results: placement policies from 2 to 1,000 workers

Every policy of `orchestrator.planner.policies` ({", ".join(POLICIES)}) in the simulator
(`simulator/`, which runs the production planner and prefix index unchanged) on {sizes}
prefill + decode workers, each engine on cores of its own (no CPU contention), on the
repository-assistant workload and the Mooncake synthetic trace. Generated by
`{report['command']}` in {report['wall_seconds'] / 60:.1f} minutes of wall time (one
process, {priority(report)}{load(report)}).{real_sections_by(report)}{quick}

* **Cost curves**: {report['calibration_source']}: {curves(report['calibration'])}.
* **Views and blocks**: {report['model']}.
* **Reuse bounds** (`kvroute.bench.oracle`, as `scripts/simulate.py` reports them): the
  unlimited cache (never evicts) and one shared LRU cache of all workers' blocks with
  perfect routing; "of LRU" and "of unlimited" are a policy's reused (cached) prompt
  tokens over the bound's. "of prefill LRU" is over one shared LRU cache of the prefill
  workers' blocks alone: in disaggregated serving a decode worker's cache also holds a copy
  of the prompt of every request it decodes, so the all-workers bound counts that capacity as
  if it stored only distinct prefixes. Both bounds ignore timing: a request may reuse blocks that another is
  still computing, which no engine can. P50/P99 are over finished requests; "429" counts rejections."""


def real_sections_by(report: dict) -> str:
    command = report.get("real_sections_by")
    return f" The real-cluster sections were redone by `{command}`." if command else ""


def priority(report: dict) -> str:
    niceness = report.get("niceness")
    if niceness is None:
        return "priority not recorded"
    return "normal priority" if niceness == 0 else f"`nice -n {niceness}`"


def load(report: dict) -> str:
    if "load_average" not in report:
        return ""
    return f", {report['cpus']} CPUs, load average {report['load_average'][0]:.1f} at the end"


def repository_scaling(report: dict, rows: list[dict]) -> str:
    base, ref, engine = report["repository_base"], report["reference_prefill"], report["repository_engine"]
    capped = [r for r in rows if r["requests"] < REQUESTS_PER_PREFILL * r["num_prefill"]]
    note = "" if report["quick"] or not capped else (
        f" At {listing([format(r['workers'], ',') for r in capped])} workers the cap of {MAX_REQUESTS:,} requests "
        f"leaves "
        f"{capped[0]['requests_per_repository']:.1f} requests per repository instead of "
        f"{rows[0]['requests_per_repository']:.1f}: more of them are a repository's first request, which misses "
        f"under any placement: the unlimited bound falls from {cell(rows[0]['oracle']['unlimited']['hit_rate'], '%')} "
        f"to {cell(capped[0]['oracle']['unlimited']['hit_rate'], '%')}.")
    sizes = table(["workers", "repositories", "requests/s", "requests", "per repository", "cold prefill load",
                   "LRU bound", "unlimited bound"],
                  [[r["workers"], r["workload"]["repositories"], f"{r['workload']['rate']:.3g}", r["requests"],
                    f"{r['requests_per_repository']:.1f}", cell(r["cold_prefill_load"], "x"),
                    cell(r["oracle"]["lru_all_workers"]["hit_rate"], "%"),
                    cell(r["oracle"]["unlimited"]["hit_rate"], "%")] for r in rows])
    return f"""### repository-assistant

Base: {base['repositories']} repositories at {base['rate']:g} requests/s for {ref} prefill workers
(prefixes of {base['prefix_min_tokens']}-{base['prefix_max_tokens']} tokens, questions of
{base['question_min_tokens']}-{base['question_max_tokens']}, {base['max_tokens']} output tokens, Zipf
{base['zipf_exponent']}, seed {base['seed']}; pseudo token ids, which share exactly what the prompts share).
At N prefill workers the repositories and the rate are multiplied by N/{ref}
(`simulator.scaling.scale_repository_assistant`, the rule of `validate_simulator.py --scale`), and every
engine keeps {engine['num_blocks']} blocks of {engine['block_size']} tokens: each prefill worker sees the
same request rate and the same share of the prefix working set at every size. Requests:
{REQUESTS_PER_PREFILL} per prefill worker, at most {MAX_REQUESTS:,}.{note} "Cold prefill load": prefill
seconds per second per prefill worker, were nothing ever cached.

{sizes}"""


def trace_scaling(report: dict, rows: list[dict]) -> str:
    engine = report["trace_engine"]
    fits = [f"{r['workers']:,}" for r in rows
            if r["oracle"]["lru_all_workers"]["reused_tokens"] >= r["oracle"]["unlimited"]["reused_tokens"]]
    sizes = table(["workers", "requests", "time scale", "trace seconds", "cold prefill load", "LRU bound",
                   "prefill LRU bound", "unlimited bound"],
                  [[r["workers"], r["requests"], f"{r['time_scale']:.4g}", f"{r['trace_seconds']:,.0f}",
                    cell(r["cold_prefill_load"], "x"), cell(r["oracle"]["lru_all_workers"]["hit_rate"], "%"),
                    cell(r["oracle"]["lru_prefill_pool"]["hit_rate"], "%"),
                    cell(r["oracle"]["unlimited"]["hit_rate"], "%")] for r in rows])
    return f"""### trace

`{Path(report['trace']).name}`, scaled as `scripts/simulate.py` scales it (512-token blocks to 64 tokens;
records over the 8,192-token context dropped: {rows[0]['dropped']}). The time scale per size comes from
`simulator.scaling.trace_time_scale`: each prefill worker gets the cold-prefill load that the trace at time
scale 1.0 puts on 4 prefill workers under the default curves (with the default curves the scale is
8 / workers, as in `scripts/simulate_scale.py`). The trace's prefixes are fixed, so cache pressure is not
kept: its working set fits the cluster's caches whole at {listing(fits) or "none of these"} workers (the LRU
bound equals the unlimited one there). Engines: {engine['num_blocks']} blocks of {engine['block_size']} tokens, the
simulator's default (the trace's prompts, up to ~7,900 tokens, need more than a small cache).

{sizes}"""


def targets_section(workloads: dict[str, list[dict]]) -> str:
    rows = []
    for target in TARGETS:
        found = [next(t for t in r["targets"] if t["target"] == target.name) for r in workloads[target.workload]]
        rows.append([target.workload, target.name] + [verdict(t) for t in found])
    sizes = [f"{r['workers']:,} workers" for r in workloads[REPOSITORY]]
    return "## Targets\n\nAgainst the targets of the evaluation, per cluster size (reported, not tuned for).\n\n" + \
        table(["workload", "target"] + sizes, rows)


def notes_section(workloads: dict[str, list[dict]]) -> str:
    """What the tables cannot say by themselves: facts of the setup, not readings of the numbers."""
    notes = []
    if any(r["num_prefill"] == 1 for r in workloads[REPOSITORY]):
        notes.append("At 2 workers there is one prefill and one decode worker: no policy can choose where a "
                     "prefix is cached, only whether the decode worker prefills a request itself (LOCAL) or takes "
                     "its KV from the prefill worker (DISAGG).")
    trace = workloads[TRACE]
    notes.append(f"The trace loads each prefill worker with {cell(trace[0]['cold_prefill_load'], 'x')} seconds of "
                 "cold prefill per second: a policy that reuses little has little or no headroom, so its queues "
                 "set the trace's TTFTs (see round_robin's).")
    return "## Notes\n\n" + "\n".join(f"* {note}" for note in notes)


def workload_section(workload: str, rows: list[dict], plots: list[str]) -> str:
    policies = table(["workers", "policy", "P50 TTFT (s)", "P99 TTFT (s)", "hit rate", "of LRU", "of prefill LRU",
                      "of unlimited", "429", "wall (s)"],
                     [[r["workers"], policy, cell(p["ttft_p50_s"]), cell(p["ttft_p99_s"]), cell(p["hit_rate"], "%"),
                       cell(p["of_lru"], "%"), cell(p.get("of_prefill_lru"), "%"), cell(p["of_unlimited"], "%"),
                       p["rejected"],
                       f"{p['wall_seconds']:.1f}"] for r in rows for policy, p in r["policies"].items()])
    names = [t["target"] for t in rows[0]["targets"]]
    ratio_rows = [[r["workers"], r["requests"]] + [verdict(t) for t in r["targets"]]
                  + [r["best_baseline_p99"] or "-", f"{r['wall_seconds']:.1f}"] for r in rows]
    figures = "\n\n".join(f"![{name}]({name})" for name in plots)
    return f"## {workload}\n\n{policies}\n\n" + table(["workers", "requests"] + names + ["best baseline at P99",
                                                                                       "wall (s)"], ratio_rows) + \
        f"\n\nTTFT CDFs at {CDF_WORKERS} workers, TTFT and hit rate against cluster size:\n\n{figures}"


def real_section(real: dict) -> str:
    summaries = table(["policy", "P50 TTFT (s)", "P99 TTFT (s)", "2nd token P99 (s)", "hit rate", "errors"],
                      [[policy, cell(s["ttft_p50_s"]), cell(s["ttft_p99_s"]), cell(s.get("second_token_p99_s")),
                        cell(s["hit_rate"], "%"), s.get("errors", 0)]
                       for policy, s in real["summaries"].items()])
    # Pages made before the real section judged its targets: judged here from its ratios.
    targets = targets_table(real.get("targets") or real_targets(REPOSITORY, real["summaries"], real["ratios"]))
    config, ratio = real["workload"], real["ratios"]
    source = f", `scripts/measure_placement.py` (`{real['source']}`)" if real.get("source") else ""
    out = (f"## The real cluster\n\n{len(real['workers'])} vLLM-CPU workers ({', '.join(real['workers'].values())}"
           f"){source}, {config['requests']} requests at {config['rate']} requests/s over {config['repositories']} "
           f"repositories: {ratio_sentence(ratio)}" + recorded(real) + f"\n\n{summaries}\n\n{targets}")
    return out + validation_table(real)


def targets_table(judged: list[dict]) -> str:
    return table(["target", "real cluster"], [[t["target"], verdict(t)] for t in judged])


def ratio_sentence(found: dict) -> str:
    ratio = target_ratios(found)
    return (f"cache_aware/round_robin P50 {cell(ratio['p50_ratio'])}, cache_aware/{ratio['best_baseline_p99']} "
            f"(best baseline) P99 {cell(ratio['p99_ratio'])}.")


def recorded(real: dict) -> str:
    return (f" As recorded by `{real['recorded_by']}`, with its validation table (the simulator as it was then)."
            if real.get("recorded_by") else "")


def real_trace_section(real: dict) -> str:
    trace, ratio = real["trace"], real["ratios"]
    scaling, bounds = trace["scaling"], trace["bounds"]
    summaries = table(["policy", "P50 TTFT (s)", "P99 TTFT (s)", "hit rate", "reused tokens", "of LRU",
                       "of unlimited", "errors"],
                      [[policy, cell(s["ttft_p50_s"]), cell(s["ttft_p99_s"]), cell(s["hit_rate"], "%"),
                        f"{s['cached_tokens']:,}", cell(s.get("of_lru_all_workers"), "%"),
                        cell(s.get("of_unlimited"), "%"), s.get("errors", 0)]
                       for policy, s in real["summaries"].items()])
    targets = targets_table(real["targets"])
    out = (f"## The real cluster: trace\n\n{len(real['workers'])} vLLM-CPU workers "
           f"({', '.join(real['workers'].values())}), `scripts/measure_trace.py` (`{real['source']}`): every record of "
           f"{trace['family_fraction']:.0%} of the trace's prefix families ({trace['kept']} requests, "
           f"{trace['dropped']} dropped), 512-token blocks as {scaling['block_tokens']} tokens, outputs "
           f"x{scaling['output_scale']:g}, time x{scaling['time_scale']:g}; {trace['kv_cache_blocks_per_worker']} "
           f"blocks of {bounds['block_size']} tokens per worker. Reuse bounds of these requests: unlimited "
           f"{bounds['unlimited']['reused_tokens']:,}, one shared LRU of all workers' blocks "
           f"{bounds['lru_all_workers']['reused_tokens']:,} of {bounds['prompt_tokens']:,} prompt tokens. "
           f"{ratio_sentence(ratio)}" + recorded(real) + f"\n\n{summaries}\n\n{targets}")
    return out + validation_table(real)


def validation_table(real: dict) -> str:
    if "comparison" not in real:
        return f"\n\nNo validation table: {real.get('validation_error')}."
    rows = [[policy, cell(r["real_p50_s"]), cell(r["sim_p50_s"]), cell(r["p50_ratio"], "x"),
             "pass" if r["within_band"] else "FAIL", "{1:.2f} ({0:.2f}-{2:.2f})".format(*r["jittered_p50_ratio"]),
             cell(r["real_p99_s"]), cell(r["sim_p99_s"]), cell(r["real_hit_rate"], "%"), cell(r["sim_hit_rate"], "%")]
            for policy, r in real["comparison"].items()]
    return (f"\n\nThe simulator on the same requests and cluster (`scripts/validate_simulator.py`'s model: "
            f"shared cores, per-step load reports, held blocks; jittered over {real['seeds']} seeds):\n\n"
            + table(["policy", "real P50", "sim P50", "sim/real", f"within ±{real['band']:.0%}",
                     "jittered sim/real, median (5-95%)", "real P99", "sim P99", "real hit", "sim hit"], rows))


def render(report: dict) -> str:
    workloads = report["workloads"]
    parts = [header_section(report), "## How each size was loaded", repository_scaling(report, workloads[REPOSITORY]),
             trace_scaling(report, workloads[TRACE]), targets_section(workloads), notes_section(workloads)]
    parts += [workload_section(name, rows, report["plots"][name]) for name, rows in workloads.items()]
    if report["real"]:
        parts.append(real_section(report["real"]))
    if report.get("real_trace"):
        parts.append(real_trace_section(report["real_trace"]))
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------- main


def simulated_part(args: argparse.Namespace, setup: Setup, started: float) -> dict:
    """Every policy at every size on both workloads: the page's tables, plots and setup."""
    sizes = QUICK_SIZES if args.quick else SIZES
    print(f"{REPOSITORY} ({setup.calibration_source})", flush=True)
    repository_rows, repository_cdf = repository_runs(
        setup, sizes, QUICK_REQUESTS_PER_PREFILL if args.quick else REQUESTS_PER_PREFILL)
    print(TRACE, flush=True)
    trace_rows, trace_cdf = trace_runs(setup, args.trace, sizes, QUICK_TRACE_RECORDS if args.quick else None)
    workloads = {REPOSITORY: repository_rows, TRACE: trace_rows}
    judge_targets(workloads)
    plots = write_plots(workloads, {REPOSITORY: repository_cdf, TRACE: trace_cdf}, args.output)
    return {"quick": args.quick, "calibration_source": setup.calibration_source,
            "calibration": setup.calibration.to_dict(), "model": setup.model,
            "reference_prefill": setup.reference_prefill, "repository_base": asdict(setup.repository),
            "repository_engine": asdict(setup.repository_settings.prefill_engine),
            "repository_decode_engine": asdict(setup.repository_settings.decode_engine),
            "trace_engine": asdict(setup.trace_settings.prefill_engine), "trace": str(args.trace),
            "stats_at_step_end": setup.repository_settings.stats_at_step_end,
            "workloads": workloads, "plots": plots,
            "wall_seconds": time.perf_counter() - started, "cpus": os.cpu_count(),
            "load_average": os.getloadavg(), "niceness": os.nice(0)}


def kept_simulation(report: dict, page: Path, output: Path) -> dict:
    """The simulated part of the page ``report`` (read from ``page``) as it recorded it, its
    plots copied beside the new page."""
    for name in (name for names in report["plots"].values() for name in names):
        if (page.parent / name).resolve() != (output / name).resolve():
            shutil.copyfile(page.parent / name, output / name)
    return {key: value for key, value in report.items() if key not in ("real", "real_trace", "real_sections_by")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = " ".join(["scripts/results_page.py"] + (argv if argv is not None else sys.argv[1:]))
    started = time.perf_counter()
    args.output.mkdir(parents=True, exist_ok=True)
    if args.keep_simulated:
        page = json.loads(args.from_page.read_text())
        report = kept_simulation(page, args.from_page, args.output) | {"real_sections_by": command}
        carried = carried_real(page, args.from_page)
    else:
        setup, carried = setup_from_page(args.from_page) if args.from_page else (make_setup(args.real), {})
        report = simulated_part(args, setup, started) | {"command": command}
    real = validation(args.real) if args.real else carried.get("real")
    real_trace = validation(args.real_trace) if args.real_trace else carried.get("real_trace")
    report |= {"real": real, "real_trace": real_trace}
    (args.output / "results.json").write_text(json.dumps(report, indent=1, default=str))
    (args.output / "RESULTS.md").write_text(render(report))
    print(f"wrote {args.output / 'RESULTS.md'} in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
