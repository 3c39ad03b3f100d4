"""Every ``kvroute bench`` sub-command, in the order ``kvroute bench --help`` lists them:
``transfer`` and ``replay`` (settings objects of their own, ``add_cli``), then each
measurement module's ``COMMAND``."""

from __future__ import annotations

import importlib

MODULES = (
    "kvroute.bench.placement.repository",  # placement
    "kvroute.bench.placement.trace",  # trace
    "kvroute.bench.disagg.cli",  # disagg
    "kvroute.bench.overhead.cli",  # orchestrator
    "kvroute.bench.transports",  # transports
    "kvroute.bench.load",  # load
    "kvroute.bench.core_sharing",  # core-sharing
    "kvroute.bench.planner",  # planner
    "kvroute.bench.index.cli",  # index
    "kvroute.bench.simulation.simulate",  # simulate
    "kvroute.bench.simulation.scale",  # simulate-scale
    "kvroute.bench.simulation.validate",  # validate-simulator
    "kvroute.bench.simulation.fit_shapes",  # fit-shapes
    "kvroute.bench.shapes.cli",  # shapes
    "kvroute.bench.results_page.cli",  # results-page
    "kvroute.bench.gpu_check.cli",  # gpu-check
    "kvroute.bench.peers.cli",  # peers
    "kvroute.bench.node_tier",  # node-tier
)


def add_cli(bench_commands) -> None:
    from kvroute.bench import replay_cli, transfer_bench

    transfer_bench.add_cli(bench_commands)
    replay_cli.add_cli(bench_commands)
    for name in MODULES:
        importlib.import_module(name).COMMAND.register(bench_commands)
