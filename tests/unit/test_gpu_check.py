"""The GPU check's check functions (kvroute.bench.gpu_check) on CPU tensors, so their
logic is tested before any GPU host runs them. ``kvroute bench gpu-check`` itself, run as a process, is in
tests/integration/test_gpu_check_script.py."""

from __future__ import annotations

import pytest
import torch

from kvroute.bench.gpu_check import cli as gpu_check
from kvroute.bench.gpu_check import copies as gpu_check_copies
from kvroute.bench.gpu_check import links as gpu_check_links

CPU = torch.device("cpu")


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


def test_a_nixl_link_is_forced_on_any_device_and_skipped_saying_why_without_nixl(monkeypatch):
    assert gpu_check_links.link_settings(torch.device("cpu"), gpu_check_links.NIXL).backend == "nixl"
    assert gpu_check_links.link_settings(torch.device("cpu")).backend == "gloo"
    monkeypatch.setattr("transfer.transports.nixl_agent.nixl_missing", lambda: "nixl_cu12 cannot be imported")
    skipped = gpu_check_links.check_nixl_link("cpu", gpu_check_links.CPU_LINK_SIZES, 5)
    assert skipped["status"] == "skipped" and skipped["reason"] == "nixl_cu12 cannot be imported"
    assert gpu_check.link_table(skipped) == ["link cpu -> cpu over nixl: skipped (nixl_cu12 cannot be imported)"]
    assert gpu_check.overall_status([], {"status": "ok"}, skipped) == "ok"
    assert gpu_check.overall_status([], {"status": "ok"}, {"status": "failed"}) == "error"
