"""A worker's probe, with real processes: a synthetic worker that finds its orchestrator
through a DNS name (``dns://localhost:PORT``, as a headless Service names replicas) writes
its status file, and ``kvroute probe worker`` run as kubelet runs it says ready once the
orchestrator accepted it, and not alive while its engine fails."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from foundation.model_prep import resolve_model
from testing.stack import SyntheticStack


def run_probe(status_file, check: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "kvroute", "probe", "worker", "--status-file", str(status_file),
                           "--max-age", "5", "--check", check], capture_output=True, text=True, timeout=30)
    return done.returncode, done.stdout.strip()


def wait_for_probe(status_file, check: str, code: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        returned, line = run_probe(status_file, check)
        if returned == code:
            return line
        assert time.monotonic() < deadline, f"probe {check} still exits {returned}: {line}"
        time.sleep(0.5)


def test_the_probe_follows_registration_and_engine_health(tmp_path):
    status_file = tmp_path / "status.json"
    stack = SyntheticStack(resolve_model(None), tmp_path / "stack.log", [], token_seconds=0.01, roles=("unified",),
                           worker_args=("--status-file", str(status_file)), registry_by_name=True)
    try:
        stack.wait_healthy(120)  # registered through the name: the orchestrator can serve
        assert "ready: registered with 1 of 1 orchestrators" in wait_for_probe(status_file, "ready", 0, 30)
        worker = stack.worker_processes["unified-0"]
        worker.send_signal(signal.SIGUSR1)  # its engine fails every request
        assert "engine unhealthy: injected failure" in wait_for_probe(status_file, "live", 1, 30)
        worker.send_signal(signal.SIGUSR1)
        assert wait_for_probe(status_file, "live", 0, 30).startswith("alive")
    finally:
        stack.stop()
