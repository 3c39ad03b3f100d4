"""The GPU check script (scripts/gpu_check.py) on a machine without a GPU: it skips cleanly,
and its check functions run here on CPU tensors, so their logic is tested before any GPU
host runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import gpu_check  # noqa: E402
import gpu_check_copies  # noqa: E402
import gpu_check_links  # noqa: E402

CPU = torch.device("cpu")


def run_script(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    output = tmp_path / "report.json"
    # From another directory: the script finds the repository by itself.
    done = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--output", str(output), *args],
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


def test_too_few_repetitions_are_refused():
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--reps", "4"])


@pytest.mark.parametrize("block_dim", [0, 1])
@pytest.mark.parametrize("dtype", gpu_check_copies.available_dtypes())
def test_round_trip_is_exact_in_both_layouts(block_dim, dtype):
    case = gpu_check_copies.make_case(gpu_check_copies.CPU_COPY_SIZES, block_dim, dtype, CPU, seed=3)
    assert case.source.block_dim == block_dim
    assert gpu_check_copies.round_trip_exact(case.source, case.target, case.source_ids, case.target_ids)


def test_a_corrupted_scatter_is_caught():
    case = gpu_check_copies.make_case(gpu_check_copies.CPU_COPY_SIZES, 1, torch.bfloat16, CPU, seed=4)
    scatter = case.target.scatter_layer

    def corrupting(layer, block_ids, data):
        scatter(layer, block_ids, data)
        case.target.layers[layer].index_fill_(1, block_ids[:1], 0)  # one moved block zeroed

    case.target.scatter_layer = corrupting
    assert not gpu_check_copies.round_trip_exact(case.source, case.target, case.source_ids, case.target_ids)


def test_layer_shapes_follow_vllm_gpu_layouts():
    sizes = gpu_check_copies.GPU_COPY_SIZES
    assert gpu_check_copies.layer_shape(sizes, 0) == (sizes.num_blocks, 2, 16, 8, 128)  # FlashInfer
    assert gpu_check_copies.layer_shape(sizes, 1) == (2, sizes.num_blocks, 16, 8, 128)  # FlashAttention


def test_ratios_are_raw_over_kvroute():
    seconds = {"gather": 2.0, "raw_index_select": 1.0, "scatter": 1.0, "raw_index_copy": 1.0,
               "raw_contiguous_copy": 0.5}
    ratios = gpu_check_copies.ratios(seconds)
    assert ratios["gather_vs_index_select"] == 0.5 and ratios["scatter_vs_index_copy"] == 1.0
    assert ratios["gather_vs_contiguous_copy"] == 0.25


def test_frame_pattern_is_the_same_on_both_ends_and_differs_by_frame():
    first, again = gpu_check_links.frame_pattern(2, 1000, CPU), gpu_check_links.frame_pattern(2, 1000, CPU)
    assert torch.equal(first, again) and first.dtype == torch.uint8
    assert not torch.equal(first, gpu_check_links.frame_pattern(3, 1000, CPU))


def test_link_results_tell_an_nccl_refusal_from_a_failure():
    same_gpu, two_gpus = ("cuda:0", "cuda:0"), ("cuda:0", "cuda:1")
    refused = "TransportError: nccl: ncclInvalidUsage: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device"
    assert gpu_check_links.link_result(same_gpu, "error", refused)["status"] == "unsupported"
    assert gpu_check_links.link_result(two_gpus, "error", refused)["status"] == "failed"
    row = gpu_check_links.summarise("nccl", 100, 2, {"link": [2.0, 1.0, 3.0], "raw": [1.0, 1.0, 1.0]}, True)
    assert row["ratio"] == 0.5 and not row["meets_target"]
    result = gpu_check_links.link_result(two_gpus, "ok", [row])
    assert result["status"] == "ok" and result["meets_target"] is False


def test_pair_devices_share_the_cpu():
    assert gpu_check_links.pair_devices("cpu") == ("cpu", "cpu")
