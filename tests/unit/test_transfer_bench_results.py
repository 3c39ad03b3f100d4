"""``kvroute bench transfer``'s result building on fake timings: sweep lengths, KV sizes,
transfer-vs-recompute rows, crossovers, and link estimates a cost model can load."""

from __future__ import annotations

import json

import pytest

from kvroute.bench.transfer_calibration import (
    estimates_report,
    link_key,
    load_link_estimates,
    observe_results,
    predicted_rows,
    transfer_observations,
)
from kvroute.bench.transfer_pair import PairPlan, summarise
from kvroute.bench.transfer_sweep import (
    KVBytes,
    crossover,
    crossovers,
    kv_bytes_from_config,
    lengths_within,
    prompt_lengths,
    result_rows,
)
from orchestrator.planner.calibration import LinkCalibrator
from orchestrator.planner.cost_model import LinkEstimate

SMOLLM2_CONFIG = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "num_hidden_layers": 30}
KV = KVBytes(bytes_per_token=46_080, num_layers=30, dtype="float32", source="model config")


def fake_pair_row(backend: str, tokens: int, seconds: list[float], raw: list[float]) -> dict:
    baseline = PairPlan(backends=(backend,), frame_sizes=(), num_frames=1).baseline(backend)
    return summarise(backend, baseline, KV.frame_bytes(tokens), KV.num_layers, {"backend": seconds, "raw": raw})


def link_seconds(tokens: int, bytes_per_second: float, latency: float) -> float:
    return latency + KV.prompt_bytes(tokens) / bytes_per_second


@pytest.mark.parametrize("max_tokens, lengths", [
    (128, [128]),
    (1000, [128, 256, 512]),
    (8192, [128, 256, 512, 1024, 2048, 4096, 8192]),
])
def test_prompt_lengths_are_powers_of_two_up_to_the_maximum(max_tokens, lengths):
    assert prompt_lengths(max_tokens) == lengths


def test_prompt_lengths_below_one_block_are_refused():
    with pytest.raises(ValueError, match="at least 128"):
        prompt_lengths(64)


def test_kv_bytes_of_smollm2_from_its_config():
    kv = kv_bytes_from_config(SMOLLM2_CONFIG, dtype_bytes=4, dtype="float32")
    assert kv == KV
    assert kv_bytes_from_config(SMOLLM2_CONFIG, dtype_bytes=2, dtype="bfloat16").bytes_per_token == 23_040
    assert KV.frame_bytes(128) * KV.num_layers == KV.prompt_bytes(128) == 5_898_240


def test_kv_bytes_that_do_not_split_over_the_layers_are_refused():
    with pytest.raises(ValueError, match="do not split"):
        KVBytes(bytes_per_token=100, num_layers=30, dtype="float32", source="engine")


def test_slow_links_keep_only_lengths_that_cross_them_in_time():
    lengths = prompt_lengths(8192)
    assert lengths_within(lengths, KV, 100 * 10**6, max_seconds=2.0) == [128, 256, 512]
    assert lengths_within(lengths, KV, 10**9, max_seconds=2.0) == [128, 256, 512, 1024, 2048, 4096]
    assert lengths_within(lengths, KV, 10**3, max_seconds=2.0) == [128]  # never nothing at all


def test_result_rows_pair_transfer_with_recompute_and_raw():
    pair_rows = [fake_pair_row("zmq-tcp", 256, [0.3, 0.1, 0.2], [0.15, 0.1, 0.05]),
                 fake_pair_row("zmq-tcp", 128, [0.05] * 5, [0.04] * 5)]
    rows = result_rows("veth-1gbit", KV, pair_rows, {128: 0.08, 256: 0.15})
    assert [(row["prompt_tokens"], row["faster"]) for row in rows] == [(128, "transfer"), (256, "recompute")]
    slow = rows[1]
    assert slow["bytes"] == KV.prompt_bytes(256)
    assert slow["transfer_seconds"] == 0.2 and slow["raw_baseline_seconds"] == 0.1
    assert slow["ratio_vs_raw"] == pytest.approx(0.5)
    assert slow["raw_baseline"] == "raw pyzmq tcp" and slow["link"] == "veth-1gbit"


def test_result_rows_without_an_engine_have_no_verdict():
    rows = result_rows("loopback", KV, [fake_pair_row("gloo", 128, [0.01] * 5, [0.01] * 5)], {})
    assert rows[0]["recompute_seconds"] is None and rows[0]["faster"] is None
    assert crossovers(rows) == []


def test_crossover_is_interpolated_on_a_log_token_axis():
    # Recompute grows faster than transfer: transfer loses at 128, wins from 512 on.
    points = [(128, 0.10, 0.05, True), (256, 0.15, 0.15, True), (512, 0.2, 0.4, True), (1024, 0.3, 0.9, True)]
    result = crossover(points)
    assert result["crossings"] == [{"prompt_tokens": 256, "between": [256, 512], "transfer_faster_above": True,
                                    "predicted": False}]
    assert result["transfer_faster_at"] == [512, 1024]
    assert result["recompute_faster_at"] == [128, 256]
    midway = crossover([(128, 0.3, 0.1, True), (512, 0.3, 0.5, True)])["crossings"][0]
    assert midway["prompt_tokens"] == 256  # the gap changes from +0.2 to -0.2: half way in log2


def test_a_crossover_next_to_a_predicted_point_says_so_and_verdicts_count_measured_points_only():
    result = crossover([(128, 0.3, 0.1, True), (512, 0.3, 0.5, False)])
    assert result["crossings"][0]["predicted"] is True
    assert result["transfer_faster_at"] == [] and result["recompute_faster_at"] == [128]


def test_no_crossover_when_one_side_always_wins():
    assert crossover([(128, 0.01, 0.05, True), (256, 0.02, 0.1, True)])["crossings"] == []


def test_crossovers_per_link_and_backend():
    recompute = {128: 0.05, 256: 0.1, 512: 0.2}
    fast = [fake_pair_row("zmq-tcp", n, [link_seconds(n, 3e9, 1e-3)] * 5, [0.01] * 5) for n in recompute]
    slow = [fake_pair_row("zmq-tcp", n, [link_seconds(n, 12.5e6, 1e-3)] * 5, [0.01] * 5) for n in recompute]
    rows = result_rows("loopback", KV, fast, recompute) + result_rows("veth-100mbit", KV, slow, recompute)
    summary = {series["link"]: series for series in crossovers(rows)}
    assert summary["loopback"]["transfer_faster_at"] == [128, 256, 512]
    assert summary["veth-100mbit"]["recompute_faster_at"] == [128, 256, 512]
    assert summary["loopback"]["crossings"] == summary["veth-100mbit"]["crossings"] == []


def test_transfers_become_link_estimates_a_cost_model_loads():
    bandwidth, latency = 120e6, 0.002
    lengths = prompt_lengths(2048)
    pair_rows = [fake_pair_row("gloo", n, [link_seconds(n, bandwidth, latency)] * 5, [1.0] * 5) for n in lengths]
    results = {"links": [{"name": "veth-1gbit", "pair_rows": pair_rows}]}
    observations = transfer_observations("veth-1gbit", pair_rows)
    assert len(observations) == 5 * len(lengths)
    assert [nbytes for _, _, nbytes, _ in observations[:len(lengths)]] == [KV.prompt_bytes(n) for n in lengths]

    calibrator = observe_results(LinkCalibrator(), results)
    results["link_estimates"] = estimates_report(calibrator)
    loaded = load_link_estimates(json.loads(json.dumps(results)))  # through results.json and back
    estimate = loaded[link_key("veth-1gbit", "gloo")]
    assert estimate == calibrator.estimate(*link_key("veth-1gbit", "gloo"))
    assert estimate.bandwidth_bytes_per_second == pytest.approx(bandwidth, rel=1e-6)
    assert estimate.latency_seconds == pytest.approx(latency, rel=1e-3)


def test_cli_flags_map_onto_the_bench_settings():
    from foundation import config
    from kvroute.bench.transfer_bench import TransferBenchSettings
    from kvroute.cli import build_parser

    args = build_parser().parse_args(["bench", "transfer", "--max-prompt-tokens", "1024", "--output", "out",
                                      "--no-engine", "--no-shaped", "--shaped-rates", "10mbit"])
    settings = config.load(TransferBenchSettings, args, environ={})
    assert (settings.max_prompt_tokens, settings.output) == (1024, "out")
    assert not settings.engine and not settings.shaped
    assert settings.shaped_rates == ("10mbit",) and settings.reps == 5


def test_lengths_a_slow_link_skipped_are_predicted_from_its_estimate():
    recompute = {128: 0.4, 1024: 2.7, 2048: 8.5}
    measured = result_rows("veth-100mbit", KV, [fake_pair_row("gloo", 128, [0.49] * 5, [0.49] * 5)], recompute)
    predicted = predicted_rows("veth-100mbit", "gloo", KV, [1024, 2048], LinkEstimate(12e6, 0.001), recompute)
    assert [row["measured"] for row in predicted] == [False, False]
    assert predicted[0]["transfer_seconds"] == pytest.approx(0.001 + KV.prompt_bytes(1024) / 12e6)
    assert predicted[0]["raw_baseline_seconds"] is None and predicted[0]["ratio_vs_raw"] is None
    assert [row["faster"] for row in predicted] == ["recompute", "transfer"]
    (series,) = crossovers(measured + predicted)
    (crossing,) = series["crossings"]
    assert crossing["between"] == [1024, 2048] and crossing["predicted"] and crossing["transfer_faster_above"]
    assert series["recompute_faster_at"] == [128]


def test_encryption_rows_compare_each_link_encrypted_and_in_clear_with_the_faster_raw_baseline():
    from kvroute.bench.transfer_phases import encryption_lengths, encryption_rows

    assert encryption_lengths([128, 256, 512, 1024, 2048]) == [128, 512, 2048]
    assert encryption_lengths([128]) == [128]
    encrypted = [summarise("zmq-tcp", "raw pyzmq tcp", 1000, 10, {"backend": [0.04], "raw": [0.012]})]
    clear = [summarise("zmq-tcp", "raw pyzmq tcp", 1000, 10, {"backend": [0.01], "raw": [0.008]})]
    [row] = encryption_rows(encrypted, clear, bytes_per_token=100)
    assert row["prompt_tokens"] == 100 and row["bytes"] == 10_000
    assert row["encryption_cost"] == pytest.approx(4.0)
    assert row["raw_ms"] == pytest.approx(8.0)
    assert row["encrypted_vs_raw"] == pytest.approx(0.2) and row["clear_vs_raw"] == pytest.approx(0.8)


def test_checksummed_timings_become_an_on_off_ratio_in_the_rows_and_the_report():
    pair = summarise("zmq-tcp", "raw pyzmq tcp", KV.frame_bytes(128), KV.num_layers,
                     {"backend": [0.010] * 3, "raw": [0.010] * 3, "checksum": [0.0125] * 3})
    assert pair["checksum_seconds"] == 0.0125 and pair["checksum_ratio"] == pytest.approx(0.8)
    [row] = result_rows("loopback", KV, [pair], {})
    assert (row["checksum_seconds"], row["checksum_ratio"]) == (0.0125, pair["checksum_ratio"])

    from rich.console import Console

    from kvroute.bench.transfer_report import checksum_table
    console = Console(width=200, record=True)
    console.print(checksum_table({"results": [row]}))
    assert "+25.0%" in console.export_text()
    assert "checksum_seconds" not in fake_pair_row("gloo", 128, [0.01], [0.01])


def test_the_into_cache_table_sets_each_path_against_the_shared_copy():
    from rich.console import Console

    from kvroute.bench.transfer_report import into_cache_table
    rows = [{"path": path, "prompt_tokens": 512, "bytes": KV.prompt_bytes(512), "seconds": seconds}
            for path, seconds in (("direct", 0.008), ("shared", 0.010), ("nixl-link", 0.020))]
    console = Console(width=200, record=True)
    console.print(into_cache_table({"into_cache": rows}))
    text = console.export_text()
    assert "8.0, 1.25x" in text and "10.0, 1.00x" in text and "20.0, 0.50x" in text and "23.6" in text


def test_the_into_cache_paths_check_what_they_pulled_against_one_pattern():
    from kvroute.bench.transfer_into_cache import paged_layers, pattern
    layers = paged_layers(KV.bytes_per_token, KV.num_layers, 2)
    assert len(layers) == 30 and layers[0].shape == (2, 3, 128, 768)  # 2 blocks would read as the lead dimension
    assert len({pattern(layer, lead, block) for layer in range(3) for lead in range(2) for block in range(8)}) > 40
