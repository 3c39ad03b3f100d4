"""What every phase of ``kvroute bench disagg`` shares: the console, the targets, the quiet
gate before each sample, the workers' clients, and small statistics of samples."""

from __future__ import annotations

import asyncio
import statistics
import sys

from rich.console import Console

from kvroute.bench.meters import ForeignLoad, wait_for_quiet

# Wide enough for the tables when the output goes to a file or pipe.
console = Console(width=None if sys.stdout.isatty() else 200)

MiB = 1024 * 1024
TARGET_RATIO = 0.8  # the goal: connector >= 0.8x raw pyzmq for transfers of 8 MB and more
TARGET_MIN_BYTES = 8 * 10**6
LEASE_RENEW_SECONDS = 12.0  # well inside the workers' default lease of 30 s
STATS_TIMEOUT = 30.0  # the workers answer stats from their event loop; slow on a loaded machine
# Other processes' load under which a sample starts (--wait-quiet).
QUIET_CORES = 0.25


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summary(samples: list[float | None]) -> dict:
    values = [v for v in samples if v is not None]
    return {"samples": samples, "median": median(values),
            "min": min(values) if values else None, "max": max(values) if values else None}


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None


def fmt(value: float | None, spec: str = ".3f", scale: float = 1.0, suffix: str = "") -> str:
    return "—" if value is None else f"{value * scale:{spec}}{suffix}"


def wait_quiet(budget: float) -> None:
    """Before the engines start (their start-up is CPU-bound too): ``meters.wait_for_quiet``."""
    wait_for_quiet(budget, threshold=QUIET_CORES, window=10.0, say=console.log)


class QuietGate:
    """Before each measurement, wait while other processes load the CPUs, from a total budget.

    On a shared machine other people's jobs come and go; each sample then starts in a
    quiet moment if one comes within the budget. The load during each sample is recorded
    anyway (``foreign_cpu_cores``)."""

    def __init__(self, budget: float, threshold: float = QUIET_CORES, window: float = 2.0):
        self.budget, self.threshold, self.window = budget, threshold, window
        self.waited = 0.0
        self.gave_up = False

    async def wait(self) -> None:
        while self.waited < self.budget:
            meter = ForeignLoad()
            await asyncio.sleep(self.window)
            load = meter.cores()
            if load < self.threshold:
                return
            self.waited += self.window
        if self.budget > 0 and not self.gave_up:
            self.gave_up = True
            console.log(f"[yellow]spent the --wait-quiet budget ({self.budget:.0f} s) waiting for other "
                        "processes; measuring under load from now on")


class Context:
    """One prefill/decode worker pair and what a phase needs to measure it; ``gate``: the quiet
    gate, shared by every pair of a run (default: one of its own)."""

    def __init__(self, args, prompts, prefill_worker, decode_worker, prefill, decode, sampling,
                 gate: QuietGate | None = None):
        self.gate = gate or QuietGate(args.wait_quiet)
        self.args, self.prompts = args, prompts
        self.prefill_worker, self.decode_worker = prefill_worker, decode_worker
        self.prefill, self.decode, self.sampling = prefill, decode, sampling
