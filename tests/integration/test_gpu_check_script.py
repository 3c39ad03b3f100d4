"""The GPU check (``kvroute bench gpu-check``) run as a process on a machine without a GPU:
it skips cleanly, and with ``--device cpu`` runs every check (its link between two processes
over Gloo) bit-exactly. Its check functions alone are in tests/unit/test_gpu_check.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvroute.bench.gpu_check import copies as gpu_check_copies
from kvroute.bench.gpu_check import links as gpu_check_links


def run_script(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    output = tmp_path / "report.json"
    # From another directory: the command needs kvroute installed, not the checkout as the working directory.
    done = subprocess.run([sys.executable, "-m", "kvroute", "bench", "gpu-check", "--output", str(output), *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    return done, json.loads(output.read_text())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the check would run")
def test_without_cuda_the_script_skips_cleanly(tmp_path):
    done, report = run_script(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "skipped: no CUDA device" in done.stdout
    assert report["status"] == "skipped" and report["reason"] == "no CUDA device"
    assert report["environment"]["cuda_available"] is False


def test_on_the_cpu_the_whole_script_runs_and_every_byte_is_exact(tmp_path):
    done, report = run_script(tmp_path, "--device", "cpu", "--reps", "5")
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["status"] == "ok"
    assert {(row["dtype"], row["block_dim"]) for row in report["copies"]} == {
        (str(dtype).removeprefix("torch."), dim) for dtype in gpu_check_copies.available_dtypes() for dim in (0, 1)}
    assert all(row["bit_exact"] for row in report["copies"])
    link = report["link"]
    assert link["status"] == "ok" and link["devices"] == ["cpu", "cpu"]
    assert [row["backend"] for row in link["rows"]] == ["gloo"] * len(gpu_check_links.CPU_LINK_SIZES.frame_sizes)
    assert all(row["bit_exact"] and row["reps"] == 5 for row in link["rows"])
    assert "gather GB/s" in done.stdout and "link cpu -> cpu" in done.stdout
    nixl_link = report["nixl_link"]  # make setup installs nixl_cu12
    assert nixl_link["status"] == "ok" and nixl_link["backend"] == "nixl"
    assert [row["backend"] for row in nixl_link["rows"]] == ["nixl"] * len(gpu_check_links.CPU_LINK_SIZES.frame_sizes)
    assert all(row["bit_exact"] and row["baseline"] == gpu_check_links.BASELINES["nixl"] for row in nixl_link["rows"])
    assert "raw: copy_ on the receiver's device" in done.stdout
