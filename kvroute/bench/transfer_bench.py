"""``kvroute bench transfer``: moving a prompt's KV against recomputing it, per backend and link.

Phases, each writing into one results document::

    engine     one kvroute worker: its KV layout (bytes per token) and the recompute
               seconds of every prompt length (skipped with --no-engine: the layout then
               comes from the model's config.json and the dtype a worker would pick)
    loopback   zmq-tcp, zmq-ipc and gloo against their raw baselines (transfer_pair), the
               zmq links under the cluster keys' CURVE encryption, as workers run them;
               nixl too where nixl_cu12 is installed, against raw pyzmq over ipc
    into cache a staged lease pulled into a paged cache by each path of one host: NIXL
               direct READs, the shared copy, a nixl link, frames (transfer_into_cache;
               skipped with --no-into-cache)
    encryption zmq-tcp and zmq-ipc links with transfer encryption on and off, against raw
               pyzmq, at three sizes (skipped with --no-encryption)
    shaped     per rate, two fresh network namespaces joined by a tc-shaped veth pair;
               zmq-tcp and gloo only (ipc would bypass the link), created and removed
               here, also on errors and Ctrl-C (skipped with --no-shaped)

Then ``DIR/results.json``, ``DIR/transfer_vs_recompute.png`` and the tables. The engine is
stopped before any transfer is timed, so its threads do not compete for the cores.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from foundation import config
from foundation.config import setting
from kvroute.bench.run_keys import speaking_to_workers

LOOPBACK_BACKENDS = ("zmq-tcp", "zmq-ipc", "gloo")
NIXL_MISSING = "nixl_cu12 is not installed (pip install --no-deps nixl-cu12==1.5.1)"
ENCRYPTION_BACKENDS = ("zmq-tcp", "zmq-ipc")
SHAPED_BACKENDS = ("zmq-tcp", "gloo")  # tcp underneath: the only traffic tc shapes


def loopback_backends() -> tuple[str, ...]:
    """The loopback phase's backends: nixl joins where its wheel is installed (looked up,
    not imported, so this command stays quick to load)."""
    return LOOPBACK_BACKENDS + (("nixl",) if importlib.util.find_spec("nixl_cu12") else ())


@dataclass(frozen=True)
class TransferBenchSettings:
    max_prompt_tokens: int = setting(8192, "longest prompt of the sweep; lengths are powers of two from 128")
    output: str = setting("results/bench_transfer", "folder for results.json and the plot")
    reps: int = setting(5, "timed repetitions per measurement, after one warm-up; medians are reported")
    engine: bool = setting(True, "measure recompute on a real engine (--no-engine: transfers only)")
    encryption: bool = setting(True, "measure the zmq links with transfer encryption on and off against raw pyzmq "
                                     "(what --transfer-encryption off saves)")
    shaped: bool = setting(True, "repeat on tc-shaped links between network namespaces (needs root)")
    shaped_rates: tuple[str, ...] = setting(("1gbit", "100mbit"), "tc rates of the shaped links, comma-separated")
    shaped_max_seconds: float = setting(2.0, "on a shaped link, only prompt lengths whose KV crosses it at its "
                                             "rate within this many seconds")
    into_cache: bool = setting(True, "pull staged leases into a paged cache by each path of one host (NIXL direct "
                                     "READs, the shared copy, a nixl link, frames), prompts of 1 MB and more")
    checksum: bool = setting(True, "also time every transfer with per-frame xxh3 checksums, interleaved with "
                                   "the plain ones (the cost of --transfer-checksum on)")
    model: str = setting("", "model folder or hub id (default: the project's SmolLM2-135M-Instruct)")
    dtype: str = setting("auto", "engine dtype; auto: what a worker picks on this machine")
    start_timeout: float = setting(900.0, "seconds to wait for the engine to start")
    progress: bool = setting(True, "progress bars redrawn in place on a terminal (--no-progress: plain lines)")

    def __post_init__(self) -> None:
        if self.reps < 1:
            raise ValueError("reps must be at least 1")
        if self.shaped_max_seconds <= 0:
            raise ValueError("shaped_max_seconds must be positive")


def add_cli(bench_commands) -> None:
    parser = bench_commands.add_parser("transfer", help="KV transfer per backend and link vs recompute on the engine")
    config.add_arguments(parser, TransferBenchSettings)
    parser.set_defaults(func=lambda args: run(config.load(TransferBenchSettings, args)))


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # so every ``finally`` (engine, namespaces) still runs


def run(settings: TransferBenchSettings) -> int:
    from rich.console import Console

    from kvroute.bench.progress import closing_report
    from kvroute.bench.transfer_phases import Phases

    console = Console(width=None if sys.stdout.isatty() else 180)
    output = Path(settings.output)
    output.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = time.perf_counter()
    # The keys of the pairs' links, and of the engine phase's worker and its RPC.
    with speaking_to_workers() as keys, closing_report(output, settings.progress, console):
        phases = Phases(settings, console, output, keys)
        return _run_phases(phases, output, console, started)


def _run_phases(phases, output: Path, console, started: float) -> int:
    try:
        phases.run_all()
    except BaseException as error:
        phases.results["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        phases.results["config"]["wall_seconds"] = time.perf_counter() - started
        path = output / "results.json"
        path.write_text(json.dumps(phases.results, indent=2, default=str))
        console.log(f"wrote {path}" + (" (partial: the run failed)" if "error" in phases.results else ""))
    phases.report()
    return 0


def describe_run(settings: TransferBenchSettings) -> dict:
    """The run's settings and where it ran, for the results document."""
    import torch
    import zmq

    return {**dataclasses.asdict(settings), "command": [sys.executable, *sys.argv],
            "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "versions": {"torch": torch.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()},
            "cuda": torch.cuda.is_available(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
