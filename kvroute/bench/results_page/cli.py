"""The results page: every placement policy on 2, 8, 64 and 1,000 simulated workers.

Each policy runs on 1 + 1, 4 + 4, 32 + 32 and 500 + 500 prefill + decode workers in the
simulator (``simulator``: the production planner and index, unchanged), each engine on
cores of its own (no CPU contention), on two workloads:

* **repository-assistant**, scaled with ``simulator.scaling.scale_repository_assistant``
  (as ``kvroute bench validate-simulator --scale`` does): repositories and rate in proportion to the
  prefill workers, the KV cache per engine unchanged, so every size has the same load
  and cache pressure per worker; ``REQUESTS_PER_PREFILL`` requests per prefill worker,
  at most ``MAX_REQUESTS`` (a size over the cap gets fewer per repository: the page says so);
* **the trace** (shared/data's Mooncake synthetic trace, scaled as ``kvroute bench simulate`` does),
  with a time scale per size from ``simulator.scaling.trace_time_scale``: the same
  cold-prefill load per prefill worker at every size.

Beside each: the reuse bounds of ``kvroute bench simulate`` (unlimited cache; one shared LRU
cache of all workers' blocks with perfect routing), and cache_aware and round_robin again with a
node KV store on every node holding 8x its engines' KV (``runs.TIER_POLICIES``,
``runs.node_tier``). Cost curves and workload base: with ``--real``, the curves fitted to that
``kvroute bench placement`` run (``simulator.from_replay``), its workload config and engine
cache, its model of per-step load reports and held blocks, and the validation table of ``kvroute
bench validate-simulator``; with ``--from-page``, what an earlier page recorded (its curves,
workload base, engines and real-cluster section), to redo the simulated part after a change to
kvroute without a new real replay (engine settings that page did not record take the workers'
current defaults); else the ``SimCalibration`` defaults and ``kvroute bench placement``'s
default workload with a cache sized by its rule.

Real-cluster sections: the repository-assistant run of ``--real`` (or the one the page of
``--from-page`` carries) and the trace run of ``--real-trace`` (a ``kvroute bench trace``
``results.json``; or the page's), each with the targets and ``kvroute bench validate-simulator``'s
table of the simulator on the same requests. ``--from-page P --keep-simulated`` keeps P's
simulated part (its tables and plots, as P's command made them) and redoes only the
real-cluster sections: for adding a real run without the ~50 minutes of simulation.

Output (``--output``, default docs/results): ``RESULTS.md``, ``results.json`` (every number
on the page) and PNG plots. ``--quick``: a smoke run (sizes 2 and 8, few requests).

Usage::

    kvroute bench results-page [--output docs/results]
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
from dataclasses import asdict
from pathlib import Path

from kvroute.bench.command import Command
from kvroute.bench.paths import DEFAULT_TRACE, REPO_ROOT
from kvroute.bench.results_page.page import render
from kvroute.bench.results_page.runs import (
    QUICK_REQUESTS_PER_PREFILL,
    QUICK_SIZES,
    QUICK_TRACE_RECORDS,
    REPOSITORY,
    REQUESTS_PER_PREFILL,
    SIZES,
    TRACE,
    judge_targets,
    repository_runs,
    trace_runs,
    validation,
)
from kvroute.bench.results_page.setup import Setup, carried_real, make_setup, setup_from_page


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "docs" / "results")
    parser.add_argument("--real", type=Path,
                        help="results.json of kvroute bench placement: the simulation's cost curves and "
                             "workload base, and the real-cluster section (with --keep-simulated: that section alone)")
    parser.add_argument("--from-page", type=Path,
                        help="results.json of an earlier page: its curves, workload base, engines and "
                             "real-cluster sections, without a new replay")
    parser.add_argument("--real-trace", type=Path, help="results.json of kvroute bench trace")
    parser.add_argument("--keep-simulated", action="store_true",
                        help="with --from-page: keep that page's simulated part, redo only the real-cluster sections")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--quick", action="store_true", help="sizes 2 and 8, few requests: a smoke run")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.keep_simulated and not args.from_page:
        parser.error("--keep-simulated keeps the simulated part of the page given by --from-page")
    if args.real and args.from_page and not args.keep_simulated:
        parser.error("--real and --from-page both give the simulation's cost curves; add --keep-simulated to "
                     "keep the page's simulation and take only the real-cluster section from --real")


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
    from kvroute.bench.results_page.plots import write_plots  # matplotlib: not for `kvroute --help`

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


def command_line(argv: list[str] | None) -> str:
    """The command this page was made with, as given (for the page to say so)."""
    if argv is None:
        name = COMMAND.name
        argv = sys.argv[sys.argv.index(name) + 1:] if name in sys.argv else sys.argv[1:]
    return " ".join([f"kvroute bench {COMMAND.name}", *argv])


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    command = command_line(argv)
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


COMMAND = Command("results-page", "the results page: every placement policy on 2 to 1,000 simulated workers",
                  __doc__, add_arguments, run, check)
parse_args = COMMAND.parse_args


def main(argv: list[str] | None = None) -> int:
    return COMMAND.execute(parse_args(argv), lambda args: run(args, argv))
