"""Validate the simulator against a real cluster: the same requests on the same cluster shape.

From a real run of ``kvroute bench placement`` or ``kvroute bench trace``
(``--real results.json``; its ``serve.log`` and ``workers/*.log`` beside it are read when
present):

1. rebuild the identical request sequence: for ``placement``, the
   repository-assistant generator with the run's config and seed, token counts and prompts
   from the model's chat template, as the run made them; for ``trace``, the same
   seeded sample of the trace's prefix families, scaled as the run scaled it (token ids
   straight from the trace's block ids). Each request's prompt length, arrival time and
   prefix group (repository, or first trace block) are checked against the real rows;
2. fit the simulator's cost curves to the run (``simulator.from_replay``) and take its
   cluster: pools, engine KV capacity and block size, which engine is bound to which core;
3. simulate every policy of the run on that cluster and compare P50/P99 TTFT and hit
   rate per policy: simulated/real P50 must lie within ``--band`` (25%). The model: the
   engines share their cores as they did (``simulator.cpu``), report their load to the
   orchestrator once per step and hold a sent prefill's blocks for a step, as vLLM does
   (``ReplayCluster.settings``). Variants show what each part does: without core
   sharing; with exact views and blocks freed at once (the simulator's defaults); and
   with the run's refused pulls replayed (the decode worker prefilled those requests
   again, on a shared core);
4. with ``--scale`` (repository-assistant runs only; the results page scales the trace),
   the same fitted costs on larger clusters of the repository-assistant workload (8 and
   1,000 workers by default, each engine on cores of its own, the run's load per prefill
   worker): the ratios cache_aware/round_robin P50 TTFT and
   cache_aware/best-baseline P99 TTFT, next to the real and simulated ones of the run.

The real P50 comes with a bootstrap interval (resampling the run's requests): over ~40
requests whose TTFT is either a cache hit (~1 s) or a miss (~5-7 s) the median can sit
in the gap between the two, where one request more or less on either side moves it by
seconds. The simulated P50 is the jitter-free run's (the pass/fail) and, beside it, the
median and 5-95% range over ``--seeds`` runs whose steps vary by the spread the fit
measured (``step_jitter``), with the share of those runs inside the band.

Output: a table per part and ``DIR/validation.json`` (``--output``, default
``results/validate_simulator``).

Usage::

    kvroute bench validate-simulator --real results/measure_placement/results.json
    kvroute bench validate-simulator --real results/measure_trace/results.json
        [--output DIR] [--band 0.25] [--scale] [--scale-shapes 4x4,500x500]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvroute.bench.command import Command
from kvroute.bench.paths import REPO_ROOT
from kvroute.bench.progress import track
from kvroute.bench.replay_results import ratios
from kvroute.bench.simulation.real_run import is_trace_run, load_real, real_p50_interval, rebuild_requests
from simulator import CpuSettings, SimCalibration, SimulationSettings, simulate
from simulator.from_replay import (
    ReplayCluster,
    calibration_from_replay,
    cluster_from_replay,
    failed_pulls,
    succeeded_rows,
)
from simulator.scaling import scale_repository_assistant
from workloads import RepositoryAssistantConfig, generate_workload

console = Console(width=int(os.environ.get("COLUMNS", "160")))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--real", type=Path, required=True, help="results.json of kvroute bench placement (or trace)")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "results" / "validate_simulator")
    parser.add_argument("--band", type=float, default=0.25, help="allowed |simulated/real - 1| of P50 TTFT")
    parser.add_argument("--seeds", type=int, default=20,
                        help="jittered runs per policy and variant (default: %(default)s)")
    parser.add_argument("--scale", action="store_true", help="also simulate larger clusters (see --scale-shapes)")
    parser.add_argument("--scale-shapes", default="4x4,500x500", help="PREFILLxDECODE,... (default: %(default)s)")
    parser.add_argument("--scale-requests", default="400,10000",
                        help="requests of each scale run, one per shape (default: %(default)s)")


def simulate_all(requests, policies: list[str], cluster: ReplayCluster, calibration: SimCalibration,
                 settings: SimulationSettings, seeds: int,
                 failures: dict[str, frozenset[int]] | None = None) -> dict[str, dict]:
    """Per policy: the jitter-free run's summary, and the P50 TTFT of each jittered run."""
    exact = replace(calibration, step_jitter=0.0)
    out = {}
    for policy in policies:
        run = replace(settings, failed_pulls=(failures or {}).get(policy, frozenset()))
        s = simulate(requests, policy, cluster.num_prefill, cluster.num_decode, exact, 0, run).summary
        jittered = [simulate(requests, policy, cluster.num_prefill, cluster.num_decode, calibration, seed,
                             run).summary.ttft_p50 for seed in range(1, seeds + 1) if calibration.step_jitter]
        out[policy] = {"ttft_p50_s": s.ttft_p50, "ttft_p99_s": s.ttft_p99, "hit_rate": s.hit_rate,
                       "finished": s.finished, "rejected": s.rejected, "local_plans": s.local_plans,
                       "disagg_plans": s.disagg_plans, "jittered_p50_s": jittered}
    return out


def compare(results: dict, simulated: dict[str, dict], band: float) -> dict[str, dict]:
    rows = succeeded_rows(results)
    table = {}
    for policy, sim in simulated.items():
        real = results["summaries"][policy]
        ratio = sim["ttft_p50_s"] / real["ttft_p50_s"]
        low, high = real_p50_interval(rows[policy])
        jittered = np.array(sim["jittered_p50_s"] or [sim["ttft_p50_s"]]) / real["ttft_p50_s"]
        table[policy] = {"real_p50_s": real["ttft_p50_s"], "real_p50_interval_s": [low, high],
                         "jittered_p50_ratio": [float(np.percentile(jittered, q)) for q in (5, 50, 95)],
                         "jittered_within_band": float(np.mean(np.abs(jittered - 1) <= band)),
                         "real_p99_s": real["ttft_p99_s"], "real_hit_rate": real["hit_rate"],
                         "sim_p50_s": sim["ttft_p50_s"], "sim_p99_s": sim["ttft_p99_s"],
                         "sim_hit_rate": sim["hit_rate"], "p50_ratio": ratio,
                         "p99_ratio": sim["ttft_p99_s"] / real["ttft_p99_s"],
                         "within_band": abs(ratio - 1) <= band, "sim_local_plans": sim["local_plans"]}
    return table


# ---------------------------------------------------------------- larger clusters


def scale_workload(results: dict, num_prefill: int, requests: int):
    """The run's workload shape at ``num_prefill`` prefill workers: repositories and rate in
    proportion, so each prefill worker sees the load and prefix variety it saw in the run."""
    config = RepositoryAssistantConfig(**results["workload"]["config"])
    real_prefill = sum(1 for w in results["workers"] if w.startswith("prefill"))
    scaled = scale_repository_assistant(config, real_prefill, num_prefill, requests)
    return generate_workload(scaled), scaled  # pseudo token ids: only the sharing shows in a cache


def simulate_scale(results: dict, cluster: ReplayCluster, calibration: SimCalibration, policies: list[str],
                   shape: str, requests: int) -> dict:
    num_prefill, num_decode = (int(part) for part in shape.split("x"))
    workload, config = scale_workload(results, num_prefill, requests)
    settings = cluster.settings(cpu=CpuSettings())  # an engine per core (or per GPU), none shared
    exact = replace(calibration, step_jitter=0.0)
    summaries, wall = {}, {}
    for policy in policies:
        result = simulate(workload, policy, num_prefill, num_decode, exact, 0, settings)
        s = result.summary
        summaries[policy] = {"ttft_p50_s": s.ttft_p50, "ttft_p99_s": s.ttft_p99, "hit_rate": s.hit_rate}
        wall[policy] = result.wall_seconds
        console.print(f"  {shape} {policy}: {result.wall_seconds:.1f} s wall", highlight=False)
    return {"shape": shape, "workload": vars(config), "requests_per_repository": config.requests / config.repositories,
            "summaries": summaries, "wall_seconds": wall, "ratios": ratios(summaries)}


# ---------------------------------------------------------------- report


def seconds(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_comparison(title: str, table: dict[str, dict], band: float) -> None:
    out = Table(title=title)
    for column in ("policy", "real P50", "real P50 90% CI", "sim P50", "sim/real", f"±{band:.0%}",
                   "jittered sim/real", "in band", "real P99", "sim P99", "sim/real P99", "real hit", "sim hit",
                   "sim local"):
        out.add_column(column, justify="left" if column == "policy" else "right")
    for policy, row in table.items():
        low, high = row["real_p50_interval_s"]
        q05, q50, q95 = row["jittered_p50_ratio"]
        out.add_row(policy, seconds(row["real_p50_s"]), f"{low:.2f}-{high:.2f}", seconds(row["sim_p50_s"]),
                    f"{row['p50_ratio']:.2f}", "pass" if row["within_band"] else "FAIL",
                    f"{q50:.2f} ({q05:.2f}-{q95:.2f})", f"{row['jittered_within_band']:.0%}",
                    seconds(row["real_p99_s"]), seconds(row["sim_p99_s"]), f"{row['p99_ratio']:.2f}",
                    f"{row['real_hit_rate']:.1%}", f"{row['sim_hit_rate']:.1%}", str(row["sim_local_plans"]))
    console.print(out)


def ratio_line(name: str, values: dict) -> str:
    p50 = values.get("cache_aware_over_round_robin_p50_ttft")
    p99 = values.get("cache_aware_over_best_baseline_p99_ttft")
    return (f"{name}: cache_aware/round_robin P50 {'-' if p50 is None else f'{p50:.2f}'}; cache_aware/"
            f"{values.get('best_baseline_p99_ttft', '-')} (best baseline) P99 {'-' if p99 is None else f'{p99:.2f}'}")


def run(args: argparse.Namespace) -> int:
    results, decisions, logs = load_real(args.real)
    if args.scale and is_trace_run(results):
        raise SystemExit("--scale simulates the repository-assistant workload; for the trace at scale see "
                         "kvroute bench results-page")
    policies = list(results["summaries"])
    requests, check = rebuild_requests(results)
    console.print(f"requests rebuilt: {check['requests']}; {check['rows_mismatched']} of {check['rows_checked']} "
                  f"real rows differ in prompt tokens, arrival or repository", highlight=False)
    cluster = cluster_from_replay(results, decisions)
    calibration = calibration_from_replay(results, decisions)
    failures = failed_pulls(results, decisions, logs)
    console.print(f"cluster: {cluster.num_prefill} prefill + {cluster.num_decode} decode, {cluster.engine.num_blocks} "
                  f"blocks of {cluster.engine.block_size} tokens each, cores {cluster.cpu.core_sets} of "
                  f"{cluster.cpu.cores}\ncalibration: {calibration.to_dict()}\nrefused pulls: "
                  f"{ {policy: sorted(indices) for policy, indices in failures.items()} }", highlight=False)

    model_name = "the model: shared cores, vLLM's per-step stats and held blocks"
    unheld = replace(cluster.engine, hold_sent_blocks=False)
    variants = {
        model_name: (cluster.settings(), None),
        "no core sharing": (cluster.settings(cpu=CpuSettings()), None),
        "exact views, blocks freed at once": (cluster.settings(stats_at_step_end=False, prefill_engine=unheld,
                                                               decode_engine=unheld), None),
        "the model + the run's refused pulls replayed": (cluster.settings(), failures)}
    tables = {}
    for name, (settings, faults) in track(variants.items(), "simulator variants", console,
                                          name=lambda variant: variant[0]):
        simulated = simulate_all(requests, policies, cluster, calibration, settings, args.seeds, faults)
        tables[name] = compare(results, simulated, args.band)
        print_comparison(f"real vs simulated TTFT, {name}", tables[name], args.band)
    model = tables[model_name]
    simulated_ratios = ratios({p: {"ttft_p50_s": r["sim_p50_s"], "ttft_p99_s": r["sim_p99_s"]}
                               for p, r in model.items()})
    console.print(ratio_line("real run", results["ratios"]), highlight=False)
    console.print(ratio_line("simulated run", simulated_ratios), highlight=False)

    scale = []
    if args.scale:
        shapes = zip(args.scale_shapes.split(","), args.scale_requests.split(","))
        for shape, count in track(shapes, "larger clusters", console, name=lambda shape: shape[0]):
            scale.append(simulate_scale(results, cluster, calibration, policies, shape, int(count)))
            hits = ", ".join(f"{policy} {s['hit_rate']:.0%}" for policy, s in scale[-1]["summaries"].items())
            console.print(ratio_line(f"repository-assistant on {shape} ({count} requests, "
                                     f"{scale[-1]['requests_per_repository']:.1f} per repository)",
                                     scale[-1]["ratios"]) + f"; hit rates {hits}", highlight=False)

    args.output.mkdir(parents=True, exist_ok=True)
    report = {"real": str(args.real), "band": args.band, "request_check": check,
              "cluster": {"num_prefill": cluster.num_prefill, "num_decode": cluster.num_decode,
                          "engine": vars(cluster.engine), "cpu": vars(cluster.cpu),
                          "worker_ids": cluster.worker_ids},
              "calibration": calibration.to_dict(),
              "failed_pulls": {policy: sorted(indices) for policy, indices in failures.items()},
              "comparison": tables, "real_ratios": results["ratios"], "simulated_ratios": simulated_ratios,
              "scale": scale}
    (args.output / "validation.json").write_text(json.dumps(report, indent=1))
    passed = sum(row["within_band"] for row in model.values())
    console.print(f"{passed} of {len(model)} policies within ±{args.band:.0%} of the real P50 TTFT; "
                  f"wrote {args.output / 'validation.json'}", highlight=False)
    return 0


COMMAND = Command("validate-simulator", "the simulator against a real placement or trace run, the same requests on "
                  "the same cluster shape", __doc__, add_arguments, run)
parse_args, main = COMMAND.parse_args, COMMAND.main
