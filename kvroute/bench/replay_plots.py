"""PNG plots of replays, one function per figure, each written to the path it is given.

matplotlib with the Agg backend: benchmarks run on machines without a display.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from kvroute.bench.replay import Row  # noqa: E402
from kvroute.bench.replay_series import busy_intervals, concurrency, default_window_s, hit_rate_windows, sample_times  # noqa: E402

DPI = 120


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


def ttft_cdf(rows_by_policy: dict[str, list[Row]], path: Path) -> Path:
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for policy, rows in rows_by_policy.items():
        values = np.sort([r.ttft_s for r in rows if r.succeeded])
        if len(values):
            axis.step(values * 1000, np.arange(1, len(values) + 1) / len(values), where="post", label=policy)
    axis.set_xscale("log")
    axis.set_xlabel("TTFT (ms, log scale)")
    axis.set_ylabel("fraction of requests")
    axis.set_title("TTFT CDF per policy")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    return _save(figure, path)


def hit_rate_bars(summaries: dict[str, dict], path: Path) -> Path:
    figure, axis = plt.subplots(figsize=(7, 4))
    names = list(summaries)
    bars = axis.bar(names, [100 * (summaries[n]["hit_rate"] or 0) for n in names], color="tab:blue")
    axis.bar_label(bars, fmt="%.0f%%")
    axis.set_ylabel("cached / prompt tokens (%)")
    axis.set_ylim(0, 100)
    axis.set_title("Prefix-cache hit rate per policy")
    return _save(figure, path)


def placement_bars(summaries: dict[str, dict], labels: list[str], path: Path) -> Path:
    """Per policy, how many requests each worker was chosen to prefill."""
    figure, axis = plt.subplots(figsize=(8, 4.5))
    names = list(summaries)
    width = 0.8 / max(len(labels), 1)
    positions = np.arange(len(names))
    for k, label in enumerate(labels):
        counts = [summaries[n].get("placed_prefilling_worker_counts", summaries[n]["prefilling_worker_counts"])
                  .get(label, 0) for n in names]
        axis.bar(positions + (k - (len(labels) - 1) / 2) * width, counts, width, label=label)
    axis.set_xticks(positions, names)
    axis.set_ylabel("requests placed")
    axis.set_title("Per-worker load: the worker each policy chose to prefill (all placed requests)")
    axis.legend()
    return _save(figure, path)


def worker_load_over_time(rows_by_policy: dict[str, list[Row]], labels: dict[str, str], path: Path) -> Path:
    """One panel per policy: requests each worker was working on, over the run."""
    figure, axes = plt.subplots(len(rows_by_policy), 1, figsize=(8, 2.6 * len(rows_by_policy)), squeeze=False,
                                sharex=True)
    for axis, (policy, rows) in zip(axes[:, 0], rows_by_policy.items()):
        times = sample_times(rows)
        for worker, intervals in sorted(busy_intervals(rows, labels).items()):
            axis.step(times, concurrency(intervals, times), where="post", label=worker)
        axis.set_title(policy)
        axis.set_ylabel("requests")
        axis.grid(True, alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize="small", loc="upper right")
    axes[-1, 0].set_xlabel("seconds since the policy's start")
    figure.suptitle("Per-worker load over time (prefilling, then decoding)")
    return _save(figure, path)


def hit_rate_over_time(rows_by_policy: dict[str, list[Row]], path: Path) -> Path:
    figure, axis = plt.subplots(figsize=(7, 4))
    window = max(default_window_s(rows) for rows in rows_by_policy.values()) if rows_by_policy else 1.0
    for policy, rows in rows_by_policy.items():
        centres, rates = hit_rate_windows(rows, window)
        axis.plot(centres, 100 * rates, marker="o", markersize=3, label=policy)
    axis.set_xlim(left=0)
    axis.set_xlabel(f"seconds since the policy's start (windows of {window:.3g} s, by send time)")
    axis.set_ylabel("cached / prompt tokens (%)")
    axis.set_ylim(0, 100)
    axis.set_title("Prefix-cache hit rate over time")
    axis.grid(True, alpha=0.3)
    axis.legend()
    return _save(figure, path)
