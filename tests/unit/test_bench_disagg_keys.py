"""``kvroute bench disagg`` starts its workers under cluster keys, as every kvroute process
must: the run's own folder unless ``KVROUTE_CLUSTER_KEYS`` names one."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from foundation import zmq_auth
from kvroute.bench.disagg import cli


def record_run(monkeypatch) -> list[tuple[str, str, bool]]:
    """(keys folder the workers inherit, identity, whether the folder held keys) per measurement."""
    seen, configured = [], []
    monkeypatch.setattr(zmq_auth, "configure", lambda keys, identity, *rest: configured.append(identity))

    def measure(args):
        folder = os.environ["KVROUTE_CLUSTER_KEYS"]
        seen.append((folder, configured[-1], (Path(folder) / "worker.key_secret").is_file()))
        return 0

    monkeypatch.setattr(cli, "measure_with_workers", measure)
    return seen


def test_a_run_without_keys_makes_its_own_and_removes_them(monkeypatch):
    monkeypatch.setenv("KVROUTE_CLUSTER_KEYS", "")  # restored after the test
    seen = record_run(monkeypatch)
    assert cli.run(argparse.Namespace()) == 0
    [(folder, identity, had_keys)] = seen
    assert folder and had_keys and identity == "orchestrator"
    assert not Path(folder).exists()


def test_a_run_speaks_under_the_given_keys(monkeypatch):
    given = os.environ["KVROUTE_CLUSTER_KEYS"]  # the test run's own folder (tests/conftest.py)
    seen = record_run(monkeypatch)
    cli.run(argparse.Namespace())
    assert [folder for folder, _, _ in seen] == [given]
