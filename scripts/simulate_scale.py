"""Time the simulator at scale: the synthetic trace over 1,000 simulated workers.

The target (issue 7): replaying the whole synthetic trace (3,946 requests after the
default scaling) over 1,000 workers takes under 60 s of wall time on the development
machine. Each policy is one replay; the time covers everything ``simulate()`` does
(token generation, block hashing, index updates and lookups, planning, engine steps).

Usage::

    .venv/bin/python scripts/simulate_scale.py [--prefill 500] [--decode 500] [--policies a,b] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the project is run from its checkout, not installed
    sys.path.insert(0, str(REPO_ROOT))

from simulator import simulate  # noqa: E402
from workloads.trace import TraceScaling, load_trace  # noqa: E402

TARGET_SECONDS = 60.0
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--prefill", type=int, default=500)
    parser.add_argument("--decode", type=int, default=500)
    parser.add_argument("--policies", default="cache_aware,round_robin")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="compress the trace's schedule: 0.008 loads 1,000 workers as 1.0 loads 8")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "results" / "simulate_scale.json")
    args = parser.parse_args(argv)
    trace = load_trace(args.trace, TraceScaling(time_scale=args.time_scale))
    rows = []
    for policy in args.policies.split(","):
        result = simulate(trace, policy, args.prefill, args.decode)
        rows.append({"policy": policy, "wall_seconds": result.wall_seconds, "events": result.events,
                     "simulated_seconds": result.simulated_seconds, "ttft_p50": result.summary.ttft_p50,
                     "hit_rate": result.summary.hit_rate, "within_target": result.wall_seconds < TARGET_SECONDS})
        print(f"{policy}: {result.wall_seconds:.1f} s wall for {trace.kept} requests on "
              f"{args.prefill}+{args.decode} workers ({result.events:,} events, "
              f"{result.simulated_seconds:.0f} s simulated); target < {TARGET_SECONDS:.0f} s: "
              f"{'MET' if rows[-1]['within_target'] else 'NOT MET'}", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"workers": args.prefill + args.decode, "requests": trace.kept,
                                       "time_scale": args.time_scale,
                                       "cpus": os.cpu_count(), "load_average": os.getloadavg(), "runs": rows},
                                      indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
