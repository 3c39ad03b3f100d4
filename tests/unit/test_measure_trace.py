"""``kvroute bench trace`` (kvroute.bench.placement.trace) without a cluster: the family sample it replays, the reuse
bounds it compares policies with (only the counted requests' share), and its dry run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvroute.bench.placement import trace as measure_trace
from workloads.trace import TraceRecord, TraceScaling

# Family 0 comes back twice (its second block shared, then a new tail), family 5 once.
RECORDS = [TraceRecord(timestamp=0, input_length=1100, output_length=10, hash_ids=[0, 1, 2]),
           TraceRecord(timestamp=500, input_length=13, output_length=1, hash_ids=[5]),
           TraceRecord(timestamp=900, input_length=1100, output_length=10, hash_ids=[0, 1, 2]),
           TraceRecord(timestamp=1300, input_length=1100, output_length=10, hash_ids=[0, 1, 3])]
SCALING = TraceScaling(block_tokens=32, max_context_tokens=4096)


def test_bounds_count_only_the_requests_past_the_warm_ones():
    trace = measure_trace.scaled_sample(RECORDS, 1.0, SCALING)
    every = measure_trace.trace_bounds(trace, 32, capacity_blocks=1000, counted_from=0)
    # Prompts of 69 tokens (2 full blocks + 5 of 512 -> 32 x 2 + ceil(76 x 32 / 512)) and 1 token.
    assert [r.prompt_tokens for r in trace.requests] == [69, 1, 69, 69]
    # The repeat reuses both full blocks; the last shares its first two blocks, 64 tokens.
    assert every["unlimited"]["reused_tokens"] == 64 + 64
    assert every["prompt_tokens"] == 69 + 1 + 69 + 69
    later = measure_trace.trace_bounds(trace, 32, capacity_blocks=1000, counted_from=3)
    assert later["unlimited"]["reused_tokens"] == 64 and later["prompt_tokens"] == 69
    tiny = measure_trace.trace_bounds(trace, 32, capacity_blocks=1, counted_from=0)
    assert tiny["lru_all_workers"]["reused_tokens"] < every["lru_all_workers"]["reused_tokens"]


def test_each_policy_gets_its_share_of_the_bounds():
    runs = SimpleNamespace(summaries={"cache_aware": {"cached_tokens": 90}, "round_robin": {"cached_tokens": 30}})
    bounds = {"unlimited": {"reused_tokens": 120}, "lru_all_workers": {"reused_tokens": 100}}
    measure_trace.shares_of_bounds(runs, bounds)
    assert runs.summaries["cache_aware"]["of_lru_all_workers"] == pytest.approx(0.9)
    assert runs.summaries["round_robin"]["of_unlimited"] == pytest.approx(0.25)
    measure_trace.shares_of_bounds(runs, {"unlimited": {"reused_tokens": 0}, "lru_all_workers": {"reused_tokens": 0}})
    assert runs.summaries["cache_aware"]["of_unlimited"] is None


def test_the_dry_run_sizes_the_caches_and_starts_nothing(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                                           "output_length": r.output_length, "hash_ids": r.hash_ids})
                               for r in RECORDS) + "\n")
    assert measure_trace.main(["--dry-run", "--trace", str(trace), "--family-fraction", "1", "--dtype", "float32",
                               "--output", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "trace: 4 requests (0 dropped)" in printed and "unlimited 128" in printed
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_sample_too_small_to_replay_is_refused():
    with pytest.raises(ValueError, match="fewer than two requests"):
        measure_trace.scaled_sample(RECORDS[:1], 1.0, SCALING)


@pytest.mark.skipif(not measure_trace.DEFAULT_TRACE.exists(), reason="shared/data not present")
def test_the_simulator_replays_the_same_sample(tmp_path):
    """``kvroute bench simulate --family-fraction`` with the same settings simulates exactly the
    requests ``kvroute bench trace`` sends, so the two can be compared request for request."""
    from kvroute.bench.simulation import simulate

    args = simulate.parse_args(["--family-fraction", "0.02", "--block-tokens", "32", "--output-scale", "0.1",
                                "--max-context-tokens", "4096", "--seed", "3"])
    simulated = simulate.load_requests(args)
    scaling = TraceScaling(block_tokens=32, output_scale=0.1, max_context_tokens=4096, seed=3)
    replayed = measure_trace.scaled_sample(measure_trace.read_trace(measure_trace.DEFAULT_TRACE), 0.02, scaling)
    assert simulated.requests == replayed.requests and len(replayed.requests) > 50
