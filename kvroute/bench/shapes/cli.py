"""Goodput of kvroute's shapes against what users run instead, in the simulator, per engine count.

For each engine count of ``--engines`` (default 8 and 64), each system of
``kvroute.bench.shapes.systems`` (kvroute's candidate shapes under the production planner;
the peers: replicas behind a prefix-hash router, behind an SGLang-style cache-aware router,
and one engine on the whole machine; round-robin replicas as a reference) replays
``kvroute bench peers``' long-output workload (4 shared 512-token prefixes, 64-token
questions, exactly 256 tokens out), ``--seconds`` of it at rising rates, and its goodput is
the largest rate at which >= 90% of the requests met TTFT <= ``--ttft-target`` and TPOT <=
``--tpot-target`` (``goodput.search``: from ``--start-per-engine`` x N req/s up by 1.25x until
a run falls short, then ``--refinements`` bisections). Printed: a table per engine count
(goodput, over the best peer's, the rates tried), kvroute's chosen shape against the best
peer, and the smallest engine count at which a split shape beats every aggregated system.

Cost curves: ``--calibration FILE`` (JSON of ``SimCalibration`` fields), else the simulator's
documented defaults (the planner's start-up values, measured on the development CPU machine).

Output: ``DIR/results.json`` (settings, curves, per engine count every system's probes and
goodput, and the verdicts).

Usage::

    kvroute bench shapes [--engines 8,64] [--seconds 40] [--shapes 8u,2p6d] [--output DIR]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvroute.bench.command import Command
from kvroute.bench.paths import REPO_ROOT
from kvroute.bench.peers.report import Targets
from kvroute.bench.progress import track
from kvroute.bench.shapes import report
from kvroute.bench.shapes.goodput import Probe, attainment, search
from kvroute.bench.shapes.systems import System, long_output, systems
from simulator import SimCalibration
from simulator.stopping import SloMissBudget

console = Console(width=int(os.environ.get("COLUMNS", "160")))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", default="8,64", help="engine counts, comma-separated (default: %(default)s)")
    parser.add_argument("--shapes", default="", help="kvroute shapes to try, comma-separated, for one engine "
                                                     "count (default: the candidates of systems.candidate_shapes)")
    parser.add_argument("--seconds", type=float, default=40.0, help="seconds of arrivals per run (default: 40)")
    parser.add_argument("--start-per-engine", type=float, default=0.5,
                        help="the first rate tried, per engine, in req/s (default: %(default)s)")
    parser.add_argument("--refinements", type=int, default=3, help="bisections after the ramp (default: 3)")
    parser.add_argument("--ttft-target", type=float, default=Targets.ttft_s)
    parser.add_argument("--tpot-target", type=float, default=Targets.tpot_s)
    parser.add_argument("--calibration", type=Path, help="JSON of SimCalibration fields")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "results" / "shapes")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        args.engines = [int(value) for value in args.engines.split(",")]
    except ValueError:
        parser.error("--engines takes whole numbers, comma-separated")
    args.shapes = [shape for shape in args.shapes.split(",") if shape]
    if min(args.engines) < 1 or args.seconds <= 0 or args.start_per_engine <= 0 or args.refinements < 0:
        parser.error("engine counts, --seconds and --start-per-engine must be positive, --refinements >= 0")
    if args.shapes and len(args.engines) != 1:
        parser.error("--shapes names shapes of one engine count: give one with --engines")


def goodput_of(system: System, engines: int, args: argparse.Namespace, targets: Targets) -> report.Outcome:
    def attain(rate: float) -> Probe:
        requests = long_output(rate, args.seconds, args.seed)
        budget = SloMissBudget(targets.ttft_s, targets.tpot_s, len(requests), targets.attainment)
        result = system.run(requests, budget)
        if result.stopped_early:
            return Probe(budget.best_possible, stopped_early=True)
        return Probe(attainment(result.records, targets))

    sweep = search(attain, args.start_per_engine * engines, targets.attainment, refinements=args.refinements)
    return report.Outcome(system.name, system.kind, system.shape, sweep)


def machine_table(verdicts: dict, targets: Targets) -> Table:
    table = Table(title=f"{verdicts['engines']} engines, long-output: goodput (req/s) with >= {targets.attainment:.0%} "
                        f"within TTFT <= {targets.ttft_s:g} s and TPOT <= {targets.tpot_s:g} s")
    for column in ("system", "kind", "shape", "goodput", "over best peer", "rates tried (attainment)"):
        table.add_column(column, justify="right" if column in ("goodput", "over best peer") else "left")
    for row in verdicts["systems"]:
        over = row["over_best_peer"]
        table.add_row(row["name"], row["kind"], row["shape"],
                      "-" if row["goodput_rps"] is None else f"{row['goodput_rps']:.3g}",
                      "-" if over is None else f"{over:.2f}x",
                      " ".join(f"{p['rate']:.3g}:{'<=' if p['stopped_early'] else ''}{p['attainment']:.0%}"
                               for p in row["probes"]))
    return table


def run(args: argparse.Namespace) -> int:
    calibration = SimCalibration.from_json(args.calibration) if args.calibration else SimCalibration()
    targets = Targets(args.ttft_target, args.tpot_target)
    reports = []
    for engines in args.engines:
        compared = systems(engines, calibration, targets.tpot_s, args.shapes or None)
        outcomes = [goodput_of(system, engines, args, targets)
                    for system in track(compared, f"{engines} engines", console, lambda system: system.name)]
        reports.append(report.machine_report(engines, outcomes))
        console.print(machine_table(reports[-1], targets))
        console.print(report.verdict(reports[-1]))
    console.print(report.crossover_line(reports))
    args.output.mkdir(parents=True, exist_ok=True)
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    (args.output / "results.json").write_text(json.dumps(
        {"settings": settings, "calibration": calibration.to_dict(), "targets": asdict(targets),
         "machines": reports, "split_first_pays_at": report.first_split_win(reports),
         "crossover": report.crossover_line(reports)}, indent=1))
    return 0


COMMAND = Command("shapes", "goodput of kvroute's shapes against the peers' models, in the simulator", __doc__,
                  add_arguments, run, check)
parse_args, main = COMMAND.parse_args, COMMAND.main
