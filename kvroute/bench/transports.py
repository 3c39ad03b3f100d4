"""Measure each transport backend against its raw baseline, between the same two processes.

Two spawned processes on loopback, one receiving, one sending (``kvroute.bench.transfer_pair``
describes the method). Per backend (zmq-tcp, zmq-ipc, gloo) and transfer size (default 8,
32 and 128 MiB, in 32 frames as a 32-layer model's per-layer frames), the backend's link
and its raw baseline move the same bytes in the same frames: plain pyzmq PUSH/PULL zero-copy over the
backend's own transport (tcp or ipc), or plain torch.distributed send/recv. The median is
reported; ratio = raw seconds / backend seconds (the target is >= 0.8).

Usage::

    kvroute bench transports [--sizes-mib 8 32 128] [--frames 32] [--reps 5] [--output DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvroute.bench.command import Command
from kvroute.bench.paths import REPO_ROOT
from kvroute.bench.progress import Bar

console = Console(width=None if sys.stdout.isatty() else 160)
MiB = 1024 * 1024
BACKENDS = ("zmq-tcp", "zmq-ipc", "gloo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--frames", type=int, default=32, help="frames per transfer (one per layer)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "results" / "measure_transports")


def print_table(rows: list[dict]) -> None:
    table = Table(title="transport backends vs raw baselines (median; ratio = raw s / backend s)")
    for column in ("backend", "MiB", "backend GB/s", "baseline", "raw GB/s", "ratio"):
        table.add_column(column, justify="left" if column in ("backend", "baseline") else "right")
    for row in rows:
        table.add_row(row["backend"], f"{row['bytes'] / MiB:.0f}", f"{row['backend_gb_per_s']:.2f}",
                      row["baseline"], f"{row['raw_gb_per_s']:.2f}", f"{row['ratio']:.2f}")
    console.print(table)


def run(args: argparse.Namespace) -> int:
    from foundation import cluster_keys
    from kvroute.bench.transfer_pair import PairPlan  # torch

    with cluster_keys.of_this_run() as keys:
        plan = PairPlan(backends=BACKENDS, frame_sizes=tuple(size * MiB // args.frames for size in args.sizes_mib),
                        num_frames=args.frames, reps=args.reps, cluster_keys=keys)
        return _measure(plan, args)


def _measure(plan, args: argparse.Namespace) -> int:
    from kvroute.bench.transfer_pair import run_pair

    with Bar(console, "backends x sizes", len(plan.backends) * len(plan.frame_sizes)) as bar:
        def log(row: dict) -> None:
            console.log(f"{row['backend']} {row['bytes'] / MiB:.0f} MiB: {row['backend_gb_per_s']:.2f} GB/s vs "
                        f"{row['raw_gb_per_s']:.2f} GB/s raw, ratio {row['ratio']:.2f}")
            bar.advance()

        rows = run_pair(plan, on_row=log)
    print_table(rows)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "results.json").write_text(json.dumps({"reps": args.reps, "rows": rows}, indent=2))
    return 0


COMMAND = Command("transports", "each transport backend against its raw baseline between two processes", __doc__,
                  add_arguments, run)
parse_args, main = COMMAND.parse_args, COMMAND.main
