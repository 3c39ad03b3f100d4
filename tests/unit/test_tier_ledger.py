"""The per-tier and per-module timings every test run ends with."""

from __future__ import annotations

import pytest

from tests.conftest import TierLedger


def report(nodeid: str, when: str, seconds: float, outcome: str = "passed") -> pytest.TestReport:
    return pytest.TestReport(nodeid, ("x", 0, nodeid), {}, outcome, None, when, duration=seconds)


def ledger_of(*runs: tuple[str, str, float, float]) -> TierLedger:
    """A ledger of tests (nodeid, tier, set-up seconds, call seconds)."""
    ledger = TierLedger()
    for nodeid, tier, setup, call in runs:
        ledger.tier[nodeid] = tier
        for when, seconds in (("setup", setup), ("call", call), ("teardown", 0.5)):
            ledger.record(report(nodeid, when, seconds))
    return ledger


def test_a_module_is_charged_its_set_up_and_every_test():
    ledger = ledger_of(("tests/e2e/test_a.py::one", "e2e", 60.0, 2.0), ("tests/e2e/test_a.py::two", "e2e", 0.0, 3.0),
                       ("tests/e2e/test_b.py::one", "e2e", 0.0, 40.0), ("tests/unit/test_c.py::one", "unit", 0, 1))
    assert ledger.slowest_modules(2) == [("tests/e2e/test_a.py", 66.0, 2), ("tests/e2e/test_b.py", 40.5, 1)]
    seconds, counts = ledger.totals()["e2e"]
    assert seconds == 106.5 and counts["passed"] == 3


def test_a_failed_call_counts_as_failed_in_its_tier():
    ledger = TierLedger()
    ledger.tier["tests/unit/test_d.py::bad"] = "unit"
    ledger.record(report("tests/unit/test_d.py::bad", "setup", 0.1))
    ledger.record(report("tests/unit/test_d.py::bad", "call", 0.2, "failed"))
    assert ledger.totals()["unit"][1]["failed"] == 1
