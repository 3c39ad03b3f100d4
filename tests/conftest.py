"""The test tiers: each test lives in one of four folders, and its folder is its marker.

    tests/unit         no process, no socket: pure functions and in-process objects
    tests/contract     real sockets (ZeroMQ, HTTP on loopback) between in-process parts,
                       the transport and transfer contract suites; no engine, no stack
    tests/integration  the orchestrator with synthetic workers and other multi-process
                       stacks, without a real vLLM engine
    tests/e2e          real vLLM engines (workers, ``kvroute serve``), the real model's preparation

The marker is applied here, by path, so a file cannot forget it, and a test outside the
four folders fails the collection. Every run ends with the time spent in each tier and in the slowest modules.

Every test speaks under one cluster key folder made for the run, as a deployment does:
this process (which plays the orchestrator, and hosts worker-side servers in contract
tests) and, through ``KVROUTE_CLUSTER_KEYS``, every process a test starts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from foundation import cluster_keys, zmq_auth

TIERS = ("unit", "contract", "integration", "e2e")
TESTS = Path(__file__).resolve().parent
SLOWEST_MODULES = 15


def tier_of(path: Path) -> str | None:
    """The tier whose folder holds ``path`` (tests/<tier>/...), or None."""
    try:
        parts = path.resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


class TierLedger:
    """Per test: its tier, the seconds of its setup, call and teardown, and its outcome."""

    def __init__(self):
        self.tier: dict[str, str] = {}
        self.seconds: dict[str, float] = defaultdict(float)
        self.outcome: dict[str, str] = {}

    def record(self, report: pytest.TestReport) -> None:
        if report.nodeid not in self.tier:
            return
        self.seconds[report.nodeid] += report.duration
        if report.failed:
            self.outcome[report.nodeid] = "failed" if report.when == "call" else "error"
        elif report.skipped and self.outcome.get(report.nodeid) not in ("failed", "error"):
            self.outcome[report.nodeid] = "skipped"
        elif report.passed and report.when == "call":
            self.outcome.setdefault(report.nodeid, "passed")

    def totals(self) -> dict[str, tuple[float, Counter]]:
        """Seconds and outcome counts of each tier that ran, in tier order."""
        seconds, counts = defaultdict(float), defaultdict(Counter)
        for nodeid, outcome in self.outcome.items():
            seconds[self.tier[nodeid]] += self.seconds[nodeid]
            counts[self.tier[nodeid]][outcome] += 1
        return {tier: (seconds[tier], counts[tier]) for tier in TIERS if tier in counts}

    def slowest_modules(self, count: int) -> list[tuple[str, float, int]]:
        """(module, seconds, tests) of the ``count`` modules that took longest: a module's stack
        set-up is charged to its first test, so per-test durations hide what a module costs."""
        seconds, tests = defaultdict(float), Counter()
        for nodeid in self.outcome:
            module = nodeid.split("::")[0]
            seconds[module] += self.seconds[nodeid]
            tests[module] += 1
        ranked = sorted(seconds, key=seconds.get, reverse=True)[:count]
        return [(module, seconds[module], tests[module]) for module in ranked]


LEDGER = TierLedger()
_KEY_FOLDER = Path(tempfile.mkdtemp(prefix="kvroute-test-keys-"))


def pytest_configure(config) -> None:
    keys = cluster_keys.load(cluster_keys.init(_KEY_FOLDER))
    os.environ["KVROUTE_CLUSTER_KEYS"] = str(_KEY_FOLDER)
    zmq_auth.configure(keys, "orchestrator")


def pytest_unconfigure(config) -> None:
    shutil.rmtree(_KEY_FOLDER, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    outside = set()
    for item in items:
        tier = tier_of(item.path)
        if tier is None:
            outside.add(item.nodeid.split("::")[0])
            continue
        item.add_marker(getattr(pytest.mark, tier))
        LEDGER.tier[item.nodeid] = tier
    if outside:
        raise pytest.UsageError(
            "tests outside the tier folders tests/unit, tests/contract, tests/integration and tests/e2e "
            "(see tests/conftest.py); move each into the folder of its tier:\n  " + "\n  ".join(sorted(outside)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    LEDGER.record(report)


def pytest_terminal_summary(terminalreporter) -> None:
    """Seconds spent in each tier (its tests' setup, call and teardown), and how many tests."""
    totals = LEDGER.totals()
    if not totals:
        return
    terminalreporter.section("time per tier")
    everything = (sum(seconds for seconds, _ in totals.values()), sum((c for _, c in totals.values()), Counter()))
    for tier, (seconds, counts) in [*totals.items(), ("total", everything)]:
        detail = ", ".join(f"{counts[kind]} {kind}" for kind in ("passed", "failed", "error", "skipped")
                           if counts[kind])
        terminalreporter.write_line(f"{tier:<12}{seconds:9.1f} s {sum(counts.values()):6d} tests  ({detail})")
    terminalreporter.section(f"slowest {SLOWEST_MODULES} modules")
    for module, seconds, tests in LEDGER.slowest_modules(SLOWEST_MODULES):
        terminalreporter.write_line(f"{seconds:9.1f} s {tests:5d} tests  {module}")
