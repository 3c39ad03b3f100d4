"""``kvroute bench replay`` end to end against a real orchestrator with synthetic workers.

One ``SyntheticStack`` per module (orchestrator with --allow-policy-override, one prefill
and one decode worker with fixed-time engines: real sockets, no model), replayed with two
policies from a workload and from a tiny Mooncake trace. Its refusals without a stack are in
tests/unit/test_bench_replay_cli.py and tests/contract/test_bench_replay_unreachable.py.
"""

from __future__ import annotations

import json

import pytest

from foundation.model_prep import resolve_model
from kvroute.cli import main
from testing.stack import SyntheticStack

POLICIES = "cache_aware,round_robin"
PLOTS = ("ttft_cdf.png", "worker_load_over_time.png", "hit_rate_over_time.png")
# Five requests over 0.4 s; the first three share two 512-token blocks, the last two one.
TRACE_LINES = [
    {"timestamp": 0, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3]},
    {"timestamp": 100, "input_length": 1200, "output_length": 3, "hash_ids": [1, 2, 4]},
    {"timestamp": 200, "input_length": 1030, "output_length": 5, "hash_ids": [1, 2, 5]},
    {"timestamp": 300, "input_length": 600, "output_length": 2, "hash_ids": [6, 7]},
    {"timestamp": 400, "input_length": 700, "output_length": 4, "hash_ids": [6, 8]},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log = tmp_path_factory.mktemp("stack") / "stack.log"
    cluster = SyntheticStack(resolve_model(None), log, ["--allow-policy-override"], token_seconds=0.002)
    try:
        cluster.wait_healthy(120)
        yield cluster
    finally:
        cluster.stop()


def replay(stack, output, *source: str) -> int:
    return main(["bench", "replay", "--url", stack.url, *source, "--policies", POLICIES, "--output", str(output)])


def check_results(output, requests: int) -> dict:
    results = json.loads((output / "results.json").read_text())
    assert list(results["summaries"]) == POLICIES.split(",")
    for summary in results["summaries"].values():
        assert summary["succeeded"] == requests and summary["errors"] == 0
        assert summary["ttft_p50_s"] > 0 and summary["ttft_p99_s"] >= summary["ttft_p50_s"]
        assert summary["e2e_p99_s"] >= summary["e2e_p50_s"] > 0
        assert summary["hit_rate"] is not None and summary["missing_decision_records"] == 0
        assert summary["wrong_policy_records"] == 0
        assert not any(summary["cache_reset"]["index_blocks_at_start"].values())  # every policy starts cold
    rows = results["requests"]
    assert len(rows) == 2 * requests
    assert all(row["error"] is None and row["status"] == 200 for row in rows)
    assert all(row["plan_kind"] in ("local", "disagg") and row["queue_wait_s"] is not None for row in rows)
    assert all(row["cached_tokens"] is not None and row["second_token_s"] is not None for row in rows)
    assert results["caches_reset_between_policies"] is True
    for plot in PLOTS:
        assert (output / plot).stat().st_size > 1000
    return results


def test_workload_replay_side_by_side(stack, tmp_path):
    assert replay(stack, tmp_path, "--workload", "repository-assistant", "--requests", "10", "--rate", "20") == 0
    results = check_results(tmp_path, 10)
    assert results["source"]["workload"] == "repository-assistant"


def test_trace_replay_sends_token_ids(stack, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in TRACE_LINES))
    assert replay(stack, tmp_path / "out", "--trace", str(trace)) == 0
    results = check_results(tmp_path / "out", len(TRACE_LINES))
    assert results["source"]["kept"] == 5 and results["source"]["dropped"] == 0
    # the default scaling turns each 512-token block into 64 tokens: 1100 tokens → 64 + 64 + 10
    assert results["requests"][0]["prompt_tokens"] == 138


def test_unknown_policy_is_a_clear_error(stack, tmp_path, capsys):
    code = main(["bench", "replay", "--url", stack.url, "--workload", "repository-assistant",
                 "--policies", "cache_aware,nope", "--output", str(tmp_path)])
    assert code == 2
    assert "policy 'nope'" in capsys.readouterr().out
    assert not (tmp_path / "results.json").exists()
