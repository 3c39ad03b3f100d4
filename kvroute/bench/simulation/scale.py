"""Time the simulator at scale: the synthetic trace over 1,000 simulated workers.

The target (issue 7): replaying the whole synthetic trace (3,946 requests after the
default scaling) over 1,000 workers takes under 60 s of wall time on the development
machine. Each policy is one replay; the time covers everything ``simulate()`` does
(token generation, block hashing, index updates and lookups, planning, engine steps).

With ``--tier-host-blocks`` (``kvroute bench simulate``'s tier flags), every node has a KV
store: the wall time with the node tier's lookups, loads and write-throughs.

Usage::

    kvroute bench simulate-scale [--prefill 500] [--decode 500] [--policies a,b] [--output FILE]
        [--tier-host-blocks N [--tier-disk-blocks M] [--workers-per-node W]]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

from kvroute.bench.command import Command
from kvroute.bench.paths import DEFAULT_TRACE, REPO_ROOT
from kvroute.bench.progress import track
from kvroute.bench.simulation.simulate import add_tier_arguments, tier_settings
from simulator import SimulationSettings, simulate
from workloads.trace import TraceScaling, load_trace

TARGET_SECONDS = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--prefill", type=int, default=500)
    parser.add_argument("--decode", type=int, default=500)
    parser.add_argument("--policies", default="cache_aware,round_robin")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="compress the trace's schedule: 0.008 loads 1,000 workers as 1.0 loads 8")
    add_tier_arguments(parser)
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "results" / "simulate_scale.json")


def run(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace, TraceScaling(time_scale=args.time_scale))
    rows, settings = [], SimulationSettings(tier=tier_settings(args))
    # Nothing redrawn during a replay: its wall time is the measurement.
    for policy in track(args.policies.split(","), "policies", Console(), redraw=False):
        result = simulate(trace, policy, args.prefill, args.decode, settings=settings)
        rows.append({"policy": policy, "wall_seconds": result.wall_seconds, "events": result.events,
                     "simulated_seconds": result.simulated_seconds, "ttft_p50": result.summary.ttft_p50,
                     "hit_rate": result.summary.hit_rate, "tier_hit_rate": result.summary.tier_hit_rate,
                     "within_target": result.wall_seconds < TARGET_SECONDS})
        print(f"{policy}: {result.wall_seconds:.1f} s wall for {trace.kept} requests on "
              f"{args.prefill}+{args.decode} workers ({result.events:,} events, "
              f"{result.simulated_seconds:.0f} s simulated); target < {TARGET_SECONDS:.0f} s: "
              f"{'MET' if rows[-1]['within_target'] else 'NOT MET'}", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"workers": args.prefill + args.decode, "requests": trace.kept,
                                       "time_scale": args.time_scale, "tier": asdict(settings.tier),
                                       "cpus": os.cpu_count(), "load_average": os.getloadavg(), "runs": rows},
                                      indent=1))
    return 0


COMMAND = Command("simulate-scale", "the simulator's wall time on the synthetic trace over 1,000 workers", __doc__,
                  add_arguments, run)
parse_args, main = COMMAND.parse_args, COMMAND.main
