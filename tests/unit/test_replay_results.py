"""The replay's summary math and time series, on hand-made rows (no server)."""

from __future__ import annotations

import numpy as np
import pytest

from kvroute.bench.replay import Row, apply_decision
from kvroute.bench.replay_results import hit_rate, percentile, ratios, row_dict, summarize
from kvroute.bench.replay_series import busy_intervals, concurrency, hit_rate_windows


def row(index, ttft=0.1, e2e=1.0, prompt=1000, cached=0, prefill="p", decode="d", error=None, sent=0.0) -> Row:
    r = Row("cache_aware", index, None, scheduled_s=sent, sent_s=sent, status=200, error=error, ttft_s=ttft,
            second_token_s=0.05, e2e_s=e2e, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=8,
            decision_policy="cache_aware", plan_kind="disagg" if prefill else "local",
            prefill_worker=prefill, decode_worker=decode)
    r.prefilling_worker = prefill or decode
    return r


@pytest.mark.parametrize("values, q, expected", [
    ([], 50, None),
    ([3.0], 99, 3.0),
    ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
    (list(range(1, 101)), 99, 99.01),  # linear between the two largest
])
def test_percentile(values, q, expected):
    result = percentile(values, q)
    assert result is None if expected is None else result == pytest.approx(expected)


def test_hit_rate_weighs_requests_by_prompt_tokens():
    rows = [row(0, prompt=1000, cached=900), row(1, prompt=100, cached=0)]
    assert hit_rate(rows) == pytest.approx(900 / 1100)
    assert hit_rate([]) is None


def test_summary_counts_only_succeeded_requests_in_latencies():
    rows = [row(0, ttft=0.1, e2e=1.0, cached=500), row(1, ttft=0.3, e2e=2.0),
            row(2, ttft=None, e2e=None, error="boom")]
    summary = summarize("cache_aware", rows, duration=4.0, labels={"p": "prefill-0", "d": "decode-0"})
    assert (summary["requests"], summary["succeeded"], summary["errors"]) == (3, 2, 1)
    assert summary["ttft_p50_s"] == pytest.approx(0.2)
    assert summary["e2e_p99_s"] == pytest.approx(1.99)
    assert summary["hit_rate"] == pytest.approx(500 / 2000)
    assert summary["throughput_rps"] == pytest.approx(0.5)
    assert summary["prefilling_worker_counts"] == {"prefill-0": 2}
    assert summary["placed_prefilling_worker_counts"] == {"prefill-0": 3}
    assert summary["queue_wait_p50_s"] is None  # no decision record gave an estimate


def test_ratios_compare_with_round_robin_and_the_best_baseline():
    summaries = {"cache_aware": {"ttft_p50_s": 0.1, "ttft_p99_s": 0.5},
                 "round_robin": {"ttft_p50_s": 0.4, "ttft_p99_s": 2.0},
                 "least_loaded": {"ttft_p50_s": 0.3, "ttft_p99_s": 1.0}}
    assert ratios(summaries) == {"cache_aware_over_round_robin_p50_ttft": pytest.approx(0.25),
                                 "best_baseline_p99_ttft": "least_loaded",
                                 "cache_aware_over_best_baseline_p99_ttft": pytest.approx(0.5)}
    assert ratios({"round_robin": summaries["round_robin"]}) == {}


def test_decision_record_fills_placement_and_queue_estimate():
    r = row(0, prefill=None, decode=None)
    apply_decision(r, {"policy": "round_robin", "predicted_reused_tokens": 256, "reason": "cheapest",
                       "chosen": {"kind": "local", "prefill_worker": None, "decode_worker": "d1",
                                  "estimate": {"ttft": 0.2, "gap": 0.0, "queue_wait": 0.05}},
                       "actual": {"reused_tokens": 128, "ttft": 0.19, "second_token_gap": 0.01, "e2e": 0.9}})
    assert (r.plan_kind, r.prefilling_worker, r.queue_wait_s, r.actual_reused_tokens) == ("local", "d1", 0.05, 128)
    assert row_dict(r)["chunk_times_s"] == [] and "chunk_times" not in row_dict(r)


def test_busy_intervals_split_prefill_and_decode_and_keep_local_whole():
    disagg, local = row(0, ttft=0.5, e2e=2.0, sent=1.0), row(1, ttft=0.2, e2e=1.0, prefill=None, sent=3.0)
    intervals = busy_intervals([disagg, local, row(2, ttft=None, error="x")], {"p": "prefill-0"})
    assert intervals == {"prefill-0": [(1.0, 1.5)], "d": [(1.5, 3.0), (3.0, 4.0)]}


def test_concurrency_counts_intervals_start_inclusive_end_exclusive():
    counts = concurrency([(0.0, 2.0), (1.0, 3.0)], np.array([0.0, 0.5, 1.0, 2.0, 3.0]))
    assert counts.tolist() == [1, 1, 2, 1, 0]


def test_hit_rate_windows_group_by_send_time():
    rows = [row(0, sent=0.2, cached=1000), row(1, sent=0.9, cached=0), row(2, sent=2.5, cached=500),
            row(3, sent=1.5, ttft=None, error="x")]
    centres, rates = hit_rate_windows(rows, window_s=1.0)
    assert centres.tolist() == [0.5, 2.5]  # the window of the failed request is left out
    assert rates.tolist() == pytest.approx([0.5, 0.5])
