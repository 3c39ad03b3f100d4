"""Fit the simulator to kvroute's real long-output runs, one topology each, and check it against them.

Each ``--real`` file is the results.json of ``kvroute bench peers --systems kvroute
--workloads long-output --kvroute-topology T`` (several rates in one file, or the same
topology's files at other rates). Per topology:

1. the cluster as ``kvroute serve`` ran it: ``plan_topology`` of the run's topology and cores
   (each engine's cores, its share of the KV memory, the role's per-request step cap), the
   real worker ids matched to its engines by role;
2. the run's requests rebuilt exactly (the long-output generator with the run's seed, its
   prompts templated by the model's tokenizer), checked against the rows' prompt tokens and
   arrival times;
3. the step curves fitted to the runs (``simulator.shape_fit``): the decode step from the
   gaps between streamed tokens, the prefill curve's scale from the prompts that had their
   engine to themselves; the link from the pulls the decision records timed (logged beside
   results.json), where the topology moved KV;
4. every rate simulated under the production planner (``cache_aware``, the run's TPOT
   target) twice: with the curves fitted to **the other rates only** (held out: the check
   that counts) and to all of them; P50/P99 TTFT and P50/P99 TPOT compared with the real
   run's, each within ``--band`` (25%) or not.

Writes ``DIR/validation.json``, ``DIR/<topology>.json`` (the all-rates curves, a
``SimCalibration``) and ``DIR/per_core.json``: one engine on one core, for the larger machines
of ``kvroute bench shapes --calibration DIR/per_core.json`` (the step curves of the
all-unified topology with one core per engine, ``2u`` on two cores; the link of the topology
that moved the most KV), and prints a table per topology. See simulator/README.md.

Usage::

    kvroute bench fit-shapes --real results/fit_1u/results.json results/fit_2u/results.json ...
        [--band 0.25] [--output results/fit_shapes]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvroute.bench.command import Command
from kvroute.bench.paths import REPO_ROOT

console = Console()
WORKLOAD = "long-output"
SYSTEM = "kvroute"
METRICS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
HELD_OUT, ALL_RATES = "held out", "all rates"


@dataclass(frozen=True)
class ShapeRuns:
    """One topology's real runs: each rate's succeeded rows, and what the cluster was."""

    topology: str
    dtype: str
    total_kv_gib: float
    cores: tuple[int, ...]
    seed: int
    tpot_target_s: float
    max_in_flight: int  # the orchestrator's per-worker cap in the run
    sources: dict  # rate -> the run's workload source (generator, its options, requests, seed)
    rows: dict  # rate -> rows
    pulls: dict = field(default_factory=dict)  # rate -> (bytes, seconds) of the pulls its decision records timed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--real", type=Path, nargs="+", required=True,
                        help="results.json files of kvroute bench peers with the kvroute system on long-output")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "results" / "fit_shapes")
    parser.add_argument("--band", type=float, default=0.25, help="allowed |simulated/real - 1| (default: %(default)s)")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    missing = [str(path) for path in args.real if not path.exists()]
    if missing:
        parser.error(f"no such results: {', '.join(missing)}")
    if not 0 < args.band < 1:
        parser.error("--band must be between 0 and 1")


# ---------------------------------------------------------------- reading


def read_runs(paths: list[Path]) -> dict[str, ShapeRuns]:
    """Topology -> its runs, over every file; a file without kvroute long-output rows is an error."""
    shapes: dict[str, ShapeRuns] = {}
    for path in paths:
        results = json.loads(path.read_text())
        system = next((s for s in results["systems"] if s["system"] == SYSTEM and not s["skipped"]), None)
        rows: dict[float, list[dict]] = {}
        for row in results["requests"]:
            if (row["system"] == SYSTEM and row["workload"] == WORKLOAD and row.get("error") is None
                    and row.get("ttft_s") is not None):
                rows.setdefault(row["rate"], []).append(row)
        if system is None or not rows:
            raise SystemExit(f"{path}: no {WORKLOAD} rows of {SYSTEM}; run kvroute bench peers --systems {SYSTEM} "
                             f"--workloads {WORKLOAD}")
        resources, settings = results["resources"], results["settings"]
        topology = resolved_topology(system["settings"]["topology"], resources["cores"])
        sources = {rate: results["sources"][f"{WORKLOAD}@{rate:g}"] for rate in rows}
        pulls = run_pulls(path, rows)
        earlier = shapes.get(topology)
        if earlier is not None:
            sources, rows, pulls = {**earlier.sources, **sources}, {**earlier.rows, **rows}, {**earlier.pulls, **pulls}
        shapes[topology] = ShapeRuns(topology, resources["dtype"], resources["total_kv_gib"],
                                     _cores(resources["cores"]), settings["seed"],
                                     planner_value(system, "tpot_target_seconds"),
                                     int(planner_value(system, "max_in_flight_per_worker")), sources, rows, pulls)
    return shapes


def run_pulls(path: Path, rows: dict[float, list[dict]]) -> dict[float, list[tuple[int, float]]]:
    """Per rate, the KV pulls of its requests, from the decision records kvroute serve logged
    (``logs/kvroute-kvroute.log`` beside results.json); none without that log."""
    from simulator.from_replay import pull_samples, read_decisions

    log = path.parent / "logs" / f"{SYSTEM}-{SYSTEM}.log"
    if not log.exists():
        return {rate: [] for rate in rows}
    by_response = {record["response_id"]: record for record in read_decisions(log)}
    return {rate: pull_samples(by_response[row["response_id"]] for row in rate_rows
                               if row.get("response_id") in by_response)
            for rate, rate_rows in rows.items()}


def resolved_topology(spec: str, cores: str) -> str:
    from kvroute.topology import plan_topology

    return plan_topology(spec, cores=list(_cores(cores)), gpus=0, kv_cache_gib=1.0).spec


def _cores(cores: str) -> tuple[int, ...]:
    from worker.cores import bound_cores

    return bound_cores(cores)


# What runs recorded before kvroute bench peers wrote the planner's defaults ran with.
DEFAULTS_BEFORE_THEY_WERE_RECORDED = {"max_in_flight_per_worker": 32, "tpot_target_seconds": 0.15}


def planner_value(system: dict, name: str) -> float:
    """A planner setting of the run: its flag in --kvroute-args, else the defaults it recorded
    (``DEFAULTS_BEFORE_THEY_WERE_RECORDED`` for a run that recorded none)."""
    args = system["settings"].get("extra_args", [])
    flag = "--" + name.replace("_", "-")
    if flag in args:
        return float(args[args.index(flag) + 1])
    return system["settings"].get("planner_defaults", DEFAULTS_BEFORE_THEY_WERE_RECORDED)[name]


# ---------------------------------------------------------------- the cluster


def cluster(shape: ShapeRuns):
    """(pools, SimulationSettings, real worker id -> cores) as ``kvroute serve`` ran the shape."""
    from kvroute.bench.placement.cluster import kv_cache_tokens
    from kvroute.topology import parse_spec, plan_topology
    from orchestrator.planner.settings import PlannerSettings
    from simulator import EngineConfig, SimulationSettings
    from simulator.cpu import CpuSettings
    from worker.block_size import CPU_BLOCK_SIZE
    from worker.settings import default_long_prefill_tokens

    planned = plan_topology(shape.topology, cores=list(shape.cores), gpus=0, kv_cache_gib=0.0,
                            total_kv_gib=shape.total_kv_gib)
    counts = parse_spec(planned.spec)
    blocks = int(kv_cache_tokens(planned.engines[0].kv_cache_gib, shape.dtype) // CPU_BLOCK_SIZE)
    engines = {role: EngineConfig(num_blocks=blocks, block_size=CPU_BLOCK_SIZE, hold_sent_blocks=True,
                                  long_prefill_tokens=default_long_prefill_tokens(role),
                                  evict_pulled_first=role == "decode") for role in ("prefill", "decode", "unified")}
    # The simulator's fleet order: prefills, decodes, unified; plan_topology's is the same.
    core_sets = tuple(_cores(engine.cores) for engine in planned.engines)
    settings = SimulationSettings(prefill_engine=engines["prefill"], decode_engine=engines["decode"],
                                  unified_engine=engines["unified"], stats_at_step_end=True,
                                  cpu=CpuSettings(cores=max(shape.cores) + 1, core_sets=core_sets),
                                  tpot_target_seconds=shape.tpot_target_s,
                                  planner=PlannerSettings(max_in_flight=shape.max_in_flight))
    return counts, settings, worker_cores(shape, planned.engines)


def worker_cores(shape: ShapeRuns, engines) -> dict[str, tuple[int, ...]]:
    """Real worker id -> its engine's cores: ids (``<role>-<suffix>``) in sorted order per role
    matched to the planned engines of that role in order."""
    ids = {worker for rows in shape.rows.values() for row in rows
           for worker in (row["prefilling_worker"], row["decode_worker"]) if worker}
    cores = {}
    for role in ("prefill", "decode", "unified"):
        planned = [engine for engine in engines if engine.role == role]
        for worker, engine in zip(sorted(w for w in ids if w.split("-")[0] == role), planned):
            cores[worker] = _cores(engine.cores)
    return cores


def rebuilt_requests(shape: ShapeRuns, rate: float, tokenizer):
    """The run's requests at ``rate`` as token ids (templated by ``tokenizer``, the model's),
    and how many of its rows they do not match."""
    from kvroute.bench.replay_sources import WORKLOADS, WorkloadChoice
    from simulator.requests import replay_requests

    source = shape.sources[rate]
    choice = WorkloadChoice(requests=source["requests"], rate=source["rate"], seed=source["seed"],
                            options=tuple(source["options"]))
    requests = replay_requests(WORKLOADS[source["generator"]](choice), tokenizer)
    by_index = {request.index: request for request in requests}
    mismatched = sum(1 for row in shape.rows[rate]
                     if row["index"] not in by_index or by_index[row["index"]].prompt_tokens != row["prompt_tokens"]
                     or abs(by_index[row["index"]].arrival_seconds - row["scheduled_s"]) > 1e-6)
    return requests, mismatched


# ---------------------------------------------------------------- comparing


def real_metrics(rows: list[dict]) -> dict[str, float]:
    ttft = [row["ttft_s"] for row in rows]
    tpot = [row["itl_s"] for row in rows if row.get("itl_s") is not None]
    return _percentiles(ttft, tpot) | {"hit_rate": sum(r["cached_tokens"] or 0 for r in rows)
                                       / max(1, sum(r["prompt_tokens"] for r in rows))}


def simulated_metrics(result) -> dict[str, float]:
    from kvroute.bench.shapes.goodput import tpot_seconds
    from simulator.records import FINISHED

    finished = [record for record in result.records if record.status == FINISHED]
    tpot = [t for record in finished if (t := tpot_seconds(record)) is not None]
    return _percentiles([record.ttft_seconds for record in finished], tpot) | {
        "hit_rate": result.summary.hit_rate, "rejected": len(result.records) - len(finished)}


def _percentiles(ttft: list[float], tpot: list[float]) -> dict[str, float]:
    return {"ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tpot_p50_s": float(np.percentile(tpot, 50)) if tpot else float("nan"),
            "tpot_p99_s": float(np.percentile(tpot, 99)) if tpot else float("nan")}


def compare(real: dict[str, float], simulated: dict[str, float], band: float) -> dict:
    ratios = {metric: simulated[metric] / real[metric] for metric in METRICS}
    return {"real": real, "simulated": simulated, "ratios": ratios,
            "within_band": {metric: bool(abs(ratio - 1) <= band) for metric, ratio in ratios.items()}}


def validate_shape(shape: ShapeRuns, band: float, tokenizer) -> dict:
    """Fits (all rates, and each rate's held-out fit) and the comparison at every rate."""
    from simulator import simulate
    from simulator.shape_fit import fit_shape

    counts, settings, cores = cluster(shape)
    fitted = fit_shape(shape.rows.values(), cores, _pulls_but(shape, None))
    report = {"topology": shape.topology, "worker_cores": cores, "fit": _fit_dict(fitted), "rates": {}}
    for rate in sorted(shape.rows):
        requests, mismatched = rebuilt_requests(shape, rate, tokenizer)
        held_out = fit_shape([rows for other, rows in shape.rows.items() if other != rate], cores,
                             _pulls_but(shape, rate))
        real = real_metrics(shape.rows[rate])
        per_fit = {}
        for name, fit in ((HELD_OUT, held_out), (ALL_RATES, fitted)):
            exact = replace(fit.calibration, step_jitter=0.0)
            result = simulate(requests, "cache_aware", counts["prefill"], counts["decode"], exact, 0, settings,
                              num_unified=counts["unified"])
            per_fit[name] = compare(real, simulated_metrics(result), band)
        report["rates"][rate] = {"requests": len(requests), "rows_mismatched": mismatched,
                                 "held_out_fit": _fit_dict(held_out), **per_fit}
    return report


def _pulls_but(shape: ShapeRuns, rate: float | None) -> list[tuple[int, float]]:
    return [pull for other, pulls in shape.pulls.items() if other != rate for pull in pulls]


def _fit_dict(fit) -> dict:
    return {"calibration": fit.calibration.to_dict(), "prefill_fitted": fit.prefill is not None,
            "prompt_costs": fit.prompt_costs, "decode_gaps": fit.decode_gaps, "pulls": fit.pulls}


# ---------------------------------------------------------------- output


def print_shape(report: dict, band: float) -> None:
    calibration, fit = report["fit"]["calibration"], report["fit"]
    console.print(f"\n[bold]{report['topology']}[/bold]: decode step "
                  f"{calibration['decode_step_fixed_seconds'] * 1e3:.1f} ms + "
                  f"{calibration['decode_per_sequence_seconds'] * 1e3:.2f} ms a sequence ({fit['decode_gaps']} gaps); "
                  f"prefill {calibration['prefill_fixed_seconds'] * 1e3:.0f} ms + "
                  f"{calibration['prefill_per_token_seconds'] * 1e3:.3f} ms a token ({fit['prompt_costs']} prompts)",
                  highlight=False)
    table = Table(title=f"{report['topology']}: real vs simulated (held-out fit; all-rates fit), within ±{band:.0%}?")
    for column in ("rate", *METRICS):
        table.add_column(column, justify="right")
    for rate, entry in report["rates"].items():
        cells = []
        for metric in METRICS:
            held, every = entry[HELD_OUT], entry[ALL_RATES]
            mark = "" if held["within_band"][metric] else " ✗"
            cells.append(f"{held['real'][metric] * 1e3:.0f} ms: {held['simulated'][metric] * 1e3:.0f}{mark}; "
                         f"{every['simulated'][metric] * 1e3:.0f}")
        table.add_row(f"{rate:g}/s", *cells)
    console.print(table)


def run(args: argparse.Namespace) -> int:
    from workloads import load_tokenizer

    shapes = read_runs(args.real)
    tokenizer = load_tokenizer()
    args.output.mkdir(parents=True, exist_ok=True)
    reports = {}
    for topology, shape in shapes.items():
        reports[topology] = validate_shape(shape, args.band, tokenizer)
        (args.output / f"{topology}.json").write_text(json.dumps(reports[topology]["fit"]["calibration"], indent=1))
        print_shape(reports[topology], args.band)
    per_core = per_core_curves(shapes, reports)
    if per_core is not None:
        (args.output / "per_core.json").write_text(json.dumps(per_core, indent=1))
    checks = [entry[HELD_OUT]["within_band"][metric] for report in reports.values()
              for entry in report["rates"].values() for metric in METRICS]
    summary = {"band": args.band, "real": [str(path) for path in args.real], "metrics": list(METRICS),
               "held_out_within_band": f"{sum(checks)} of {len(checks)}", "shapes": reports}
    (args.output / "validation.json").write_text(json.dumps(summary, indent=1))
    console.print(f"held-out fits: {sum(checks)} of {len(checks)} metrics within ±{args.band:.0%} of the real runs",
                  highlight=False)
    return 0


def per_core_curves(shapes: dict[str, ShapeRuns], reports: dict[str, dict]) -> dict | None:
    """One engine on one core (see the module docstring); None without such a topology."""
    from kvroute.topology import parse_spec

    def one_unified_engine_per_core(topology: str) -> bool:
        counts = parse_spec(topology)
        return counts["unified"] == sum(counts.values()) == len(shapes[topology].cores)

    steps = next((reports[topology]["fit"]["calibration"] for topology in shapes
                  if one_unified_engine_per_core(topology)), None)
    if steps is None:
        return None
    steps = {**steps, "step_jitter": 0.0}  # as the check ran them: the exact curves
    moved = max(reports.values(), key=lambda report: report["fit"]["pulls"])
    if not moved["fit"]["pulls"]:
        return steps
    link = moved["fit"]["calibration"]
    return {**steps, "link_latency_seconds": link["link_latency_seconds"],
            "link_bandwidth_bytes_per_second": link["link_bandwidth_bytes_per_second"]}


COMMAND = Command("fit-shapes", "the simulator fitted to kvroute's real long-output runs of each topology, and "
                  "checked against them at rates held out of the fit", __doc__, add_arguments, run, check)
parse_args, main = COMMAND.parse_args, COMMAND.main
