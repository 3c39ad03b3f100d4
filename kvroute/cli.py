"""The ``kvroute`` command: one entry point, one sub-command per process or task."""

from __future__ import annotations

import argparse
import sys

from kvroute import model_prep
from kvroute.worker import cli_args as worker_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute", description="Cache-aware, disaggregated LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True)
    model_prep.add_cli(commands)
    for role in ("prefill", "decode"):
        sub = commands.add_parser(f"{role}-worker", help=f"run one {role} worker (a vLLM engine)")
        worker_cli.add_worker_arguments(sub)
        sub.set_defaults(func=lambda args, role=role: _run_worker(args, role))
    return parser


def _run_worker(args: argparse.Namespace, role: str) -> int:
    from kvroute.worker.process import run_worker

    run_worker(worker_cli.settings_from_args(args, role), args.ready_file)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
