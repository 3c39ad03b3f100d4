"""Time series of one policy's replay, for the over-time plots. Pure functions over ``Row``s.

Times are seconds since the run's start (``Row.sent_s``). A worker is busy with a request

    prefilling worker:  sent ──────▶ first token          (the prefill, queue included)
    decode worker:                   first token ──▶ end   (DISAGG: after the hand-off)

and a LOCAL request's decode worker does both, so it is busy from sent to end. Only
requests that succeeded and have a decision record are counted.
"""

from __future__ import annotations

import math

import numpy as np

from kvroute.bench.replay import Row

Interval = tuple[float, float]


def busy_intervals(rows: list[Row], labels: dict[str, str] | None = None) -> dict[str, list[Interval]]:
    """Worker label → the (start, end) of every request it worked on."""
    labels = labels or {}
    intervals: dict[str, list[Interval]] = {}
    for row in rows:
        if not row.succeeded or row.e2e_s is None or row.prefilling_worker is None:
            continue
        first, end = row.sent_s + row.ttft_s, row.sent_s + row.e2e_s
        prefilling = labels.get(row.prefilling_worker, row.prefilling_worker)
        intervals.setdefault(prefilling, []).append((row.sent_s, first))
        if row.decode_worker and row.decode_worker != row.prefilling_worker:
            intervals.setdefault(labels.get(row.decode_worker, row.decode_worker), []).append((first, end))
        else:  # LOCAL: the same worker decodes after prefilling
            intervals[prefilling][-1] = (row.sent_s, end)
    return intervals


def concurrency(intervals: list[Interval], times: np.ndarray) -> np.ndarray:
    """How many intervals hold each time (start inclusive, end exclusive)."""
    starts = np.sort([start for start, _ in intervals])
    ends = np.sort([end for _, end in intervals])
    return np.searchsorted(starts, times, side="right") - np.searchsorted(ends, times, side="right")


def sample_times(rows: list[Row], points: int = 200) -> np.ndarray:
    ends = [r.sent_s + r.e2e_s for r in rows if r.e2e_s is not None]
    last = max(ends, default=0.0)
    return np.linspace(0.0, last, points) if last > 0 else np.zeros(1)


def hit_rate_windows(rows: list[Row], window_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Per window of ``window_s`` seconds by send time: (window centres, cached / prompt tokens).
    Windows without a succeeded request are left out."""
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    prompt: dict[int, int] = {}
    cached: dict[int, int] = {}
    for row in rows:
        if row.succeeded and row.prompt_tokens:
            window = math.floor(row.sent_s / window_s)
            prompt[window] = prompt.get(window, 0) + row.prompt_tokens
            cached[window] = cached.get(window, 0) + (row.cached_tokens or 0)
    windows = sorted(prompt)
    centres = np.array([(w + 0.5) * window_s for w in windows])
    return centres, np.array([cached[w] / prompt[w] for w in windows])


def default_window_s(rows: list[Row], windows: int = 20) -> float:
    """``windows`` windows over the span of send times (one second if every request went at once)."""
    last = max((r.sent_s for r in rows if not math.isnan(r.sent_s)), default=0.0)
    return last / windows if last > 0 else 1.0
