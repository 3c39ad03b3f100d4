"""The status page's last minutes: TTFT percentiles and hit rate per time bucket, from a
bounded ring that forgets what left the window."""

from __future__ import annotations

import pytest

from orchestrator.recent_activity import TTFT_BIN_EDGES, TTFT_BIN_GROWTH, RecentActivity, ttft_quantile

WINDOW, BUCKET = 60.0, 10.0


def bin_counts(**by_edge_index: int) -> list[int]:
    counts = [0] * (len(TTFT_BIN_EDGES) + 1)
    for name, count in by_edge_index.items():
        counts[int(name[1:])] = count
    return counts


@pytest.mark.parametrize(("counts", "q", "expected"), [
    (bin_counts(), 0.5, None),                              # no samples
    (bin_counts(i3=1), 0.5, TTFT_BIN_EDGES[3]),             # one sample: every quantile is its bin
    (bin_counts(i3=1), 0.99, TTFT_BIN_EDGES[3]),
    (bin_counts(i3=9, i20=1), 0.5, TTFT_BIN_EDGES[3]),
    (bin_counts(i3=9, i20=1), 0.9, TTFT_BIN_EDGES[3]),      # the 9th of 10 is still in the low bin
    (bin_counts(i3=9, i20=1), 0.95, TTFT_BIN_EDGES[20]),
    (bin_counts(i64=2), 0.5, TTFT_BIN_EDGES[-1]),           # beyond the last edge: the last edge
])
def test_quantiles_are_the_upper_edge_of_their_bin(counts, q, expected):
    assert ttft_quantile(counts, q) == expected


@pytest.mark.parametrize("ttft", [0.0004, 0.018, 0.25, 3.0, 42.0])
def test_a_ttft_is_reported_within_one_bin_above_it(ttft):
    activity = RecentActivity(WINDOW, BUCKET)
    activity.observe(1000.0, prompt_tokens=100, reused_tokens=0, ttft=ttft, failed=False)
    p50 = activity.summary(1000.0)["totals"]["ttft_p50"]
    assert ttft <= p50 < max(ttft, TTFT_BIN_EDGES[0]) * TTFT_BIN_GROWTH


def test_totals_and_buckets_over_the_window():
    activity = RecentActivity(WINDOW, BUCKET)
    activity.observe(1001.0, prompt_tokens=100, reused_tokens=75, ttft=0.1, failed=False)
    activity.observe(1005.0, prompt_tokens=100, reused_tokens=25, ttft=0.1, failed=False)
    activity.observe(1032.0, prompt_tokens=200, reused_tokens=0, ttft=2.0, failed=False)
    activity.observe(1033.0, prompt_tokens=50, reused_tokens=None, ttft=None, failed=True)  # no first token
    summary = activity.summary(1035.0)
    totals = summary["totals"]
    assert (totals["requests"], totals["failed"], totals["hit_rate"]) == (4, 1, 100 / 400)
    assert totals["ttft_p50"] < 0.13 and totals["ttft_p95"] >= 2.0
    buckets = summary["buckets"]
    assert len(buckets) == WINDOW / BUCKET and [b["start"] for b in buckets] == [980, 990, 1000, 1010, 1020, 1030]
    assert [b["requests"] for b in buckets] == [0, 0, 2, 0, 0, 2]
    assert buckets[2]["hit_rate"] == 0.5 and buckets[5]["hit_rate"] == 0.0
    assert buckets[0] == {"start": 980, "requests": 0, "failed": 0, "ttft_p50": None, "ttft_p95": None,
                          "hit_rate": None}


def test_requests_leave_the_window_and_their_slot_is_reused():
    activity = RecentActivity(WINDOW, BUCKET)
    activity.observe(1000.0, prompt_tokens=100, reused_tokens=100, ttft=0.1, failed=False)
    assert activity.summary(1059.0)["totals"]["requests"] == 1
    assert activity.summary(1060.0)["totals"]["requests"] == 0  # its bucket left the window
    activity.observe(1061.0, prompt_tokens=100, reused_tokens=0, ttft=0.5, failed=False)  # same slot of the ring
    totals = activity.summary(1061.0)["totals"]
    assert (totals["requests"], totals["hit_rate"]) == (1, 0.0)


def test_after_an_hour_only_the_window_is_counted_in_as_many_buckets_as_it_holds():
    activity = RecentActivity(WINDOW, BUCKET)
    for second in range(0, 3600, 3):
        activity.observe(float(second), prompt_tokens=10, reused_tokens=5, ttft=0.01 * (second % 50), failed=False)
    summary = activity.summary(3599.0)
    assert activity.num_buckets == len(summary["buckets"]) == 6
    assert summary["totals"]["requests"] == 20  # 3540 to 3597 s, one every 3 s


@pytest.mark.parametrize(("window", "bucket"), [(60.0, 0.0), (10.0, 60.0), (float("inf"), 10.0), (60.0, -1.0)])
def test_a_window_must_hold_at_least_one_finite_bucket(window, bucket):
    with pytest.raises(ValueError):
        RecentActivity(window, bucket)
