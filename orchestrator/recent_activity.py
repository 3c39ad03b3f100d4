"""The last minutes of traffic, for the status page: time to first token and prefix-cache
hit rate per time bucket (``GET /admin/status``).

Bounded whatever the load: a ring of ``window / bucket`` buckets, each holding token counts
and a fixed log-spaced TTFT histogram, so a request costs one O(1) update and a summary
reads at most a few thousand integers. Percentiles come from the histogram, within one
bin's width (``TTFT_BIN_GROWTH``): plenty for a page a person reads, and Prometheus keeps
the exact series. Single writer: the completion service, on the event loop.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

TTFT_BIN_GROWTH = 1.25  # each bin's upper edge is 25% above the last one's
TTFT_FIRST_EDGE = 0.001  # seconds; everything faster lands in the first bin
TTFT_BIN_EDGES = tuple(TTFT_FIRST_EDGE * TTFT_BIN_GROWTH ** i for i in range(64))  # up to ~1.3 hours


@dataclass
class Bucket:
    """What finished in one time bucket. ``start`` is its bucket number (seconds // size)."""

    start: int
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    ttft_counts: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BIN_EDGES) + 1))

    def add(self, other: Bucket) -> None:
        self.requests += other.requests
        self.failed += other.failed
        self.prompt_tokens += other.prompt_tokens
        self.reused_tokens += other.reused_tokens
        self.ttft_counts = [a + b for a, b in zip(self.ttft_counts, other.ttft_counts)]

    def describe(self, bucket_seconds: float) -> dict:
        return {"start": self.start * bucket_seconds, "requests": self.requests, "failed": self.failed,
                "ttft_p50": ttft_quantile(self.ttft_counts, 0.5), "ttft_p95": ttft_quantile(self.ttft_counts, 0.95),
                "hit_rate": self.reused_tokens / self.prompt_tokens if self.prompt_tokens else None}


def ttft_quantile(counts: list[int], q: float) -> float | None:
    """The upper edge of the bin holding the ``q`` quantile (None without samples)."""
    total = sum(counts)
    if not total:
        return None
    rank, seen = max(1, math.ceil(q * total)), 0
    for index, count in enumerate(counts):
        seen += count
        if seen >= rank:
            return TTFT_BIN_EDGES[min(index, len(TTFT_BIN_EDGES) - 1)]
    return TTFT_BIN_EDGES[-1]


class RecentActivity:
    """Requests finished in the last ``window_seconds``, in buckets of ``bucket_seconds``.
    Time is passed in (wall-clock seconds), so the page can label buckets with it."""

    def __init__(self, window_seconds: float = 300.0, bucket_seconds: float = 10.0):
        if not (0 < bucket_seconds <= window_seconds < math.inf):
            raise ValueError("need 0 < bucket_seconds <= window_seconds, both finite")
        self.window_seconds, self.bucket_seconds = window_seconds, bucket_seconds
        self.num_buckets = math.ceil(window_seconds / bucket_seconds)
        self._ring: list[Bucket | None] = [None] * self.num_buckets

    def observe(self, now: float, prompt_tokens: int, reused_tokens: int | None, ttft: float | None,
                failed: bool) -> None:
        """One finished placement. ``reused_tokens`` and ``ttft`` are None when no first
        token came (an error, or the client left): it counts as a request, not in the rates."""
        bucket = self._bucket(now)
        bucket.requests += 1
        bucket.failed += failed
        if reused_tokens is not None:
            bucket.prompt_tokens += prompt_tokens
            bucket.reused_tokens += reused_tokens
        if ttft is not None:
            bucket.ttft_counts[bisect.bisect_left(TTFT_BIN_EDGES, ttft)] += 1

    def summary(self, now: float) -> dict:
        """Every bucket of the window, oldest first (empty ones too, so a chart's x-axis is
        time), and the totals over the window."""
        current = self._bucket_number(now)
        buckets = [self._stored(number) or Bucket(number) for number in range(current - self.num_buckets + 1,
                                                                               current + 1)]
        total = Bucket(current)
        for bucket in buckets:
            total.add(bucket)
        totals = total.describe(self.bucket_seconds)
        del totals["start"]
        return {"window_seconds": self.window_seconds, "bucket_seconds": self.bucket_seconds, "totals": totals,
                "buckets": [b.describe(self.bucket_seconds) for b in buckets]}

    def _bucket_number(self, now: float) -> int:
        return math.floor(now / self.bucket_seconds)

    def _stored(self, number: int) -> Bucket | None:
        bucket = self._ring[number % self.num_buckets]
        return bucket if bucket is not None and bucket.start == number else None

    def _bucket(self, now: float) -> Bucket:
        number = self._bucket_number(now)
        bucket = self._stored(number)
        if bucket is None:  # the slot held a bucket that aged out of the window (or none)
            bucket = self._ring[number % self.num_buckets] = Bucket(number)
        return bucket
