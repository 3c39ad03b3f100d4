"""The results page's plots: TTFT and hit rate against cluster size, TTFT CDFs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import matplotlib.pyplot as plt

from kvroute.bench.replay_plots import _save as save_figure  # same style, same DPI; its import picks Agg
from kvroute.bench.replay_plots import ttft_cdf
from kvroute.bench.results_page.runs import CDF_WORKERS
from orchestrator.planner.policies import POLICIES

FIGSIZE = (7.5, 25 / 6)  # 900 x 500 pixels at replay_plots' 120 DPI


def plot_ttft(rows: list[dict], title: str, path: Path) -> Path:
    figure, axes = plt.subplots(1, 2, figsize=FIGSIZE, sharey=True)
    workers = [row["workers"] for row in rows]
    for axis, (key, label) in zip(axes, (("ttft_p50_s", "P50"), ("ttft_p99_s", "P99"))):
        for policy in POLICIES:
            axis.plot(workers, [row["policies"][policy][key] for row in rows], marker="o", label=policy)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xticks(workers, [str(w) for w in workers])
        axis.set_xlabel("workers (prefill + decode, log scale)")
        axis.set_title(f"{label} TTFT")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("seconds (log scale)")
    axes[0].legend(fontsize="small")
    figure.suptitle(title)
    return save_figure(figure, path)


def plot_hit_rate(rows: list[dict], title: str, path: Path) -> Path:
    figure, axis = plt.subplots(figsize=FIGSIZE)
    workers = [row["workers"] for row in rows]
    for policy in POLICIES:
        axis.plot(workers, [100 * row["policies"][policy]["hit_rate"] for row in rows], marker="o", label=policy)
    for key, label, style in (("lru_all_workers", "shared LRU, perfect routing", "--"),
                              ("unlimited", "unlimited cache", ":")):
        axis.plot(workers, [100 * row["oracle"][key]["hit_rate"] for row in rows], style, color="black", label=label)
    axis.set_xscale("log")
    axis.set_xticks(workers, [str(w) for w in workers])
    axis.set_xlabel("workers (prefill + decode, log scale)")
    axis.set_ylabel("cached / prompt tokens (%)")
    axis.set_ylim(0, 100)
    axis.set_title(title)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the lines, not on them
    return save_figure(figure, path)


def plot_cdf(ttfts: dict[str, list[float]], path: Path) -> Path:
    """``replay_plots.ttft_cdf`` over simulated TTFTs (it reads ``ttft_s`` and ``succeeded``)."""
    rows = {policy: [SimpleNamespace(ttft_s=t, succeeded=True) for t in values] for policy, values in ttfts.items()}
    return ttft_cdf(rows, path)


def write_plots(workloads: dict[str, list[dict]], cdfs: dict[str, dict], output: Path) -> dict[str, list[str]]:
    plots = {}
    for workload, rows in workloads.items():
        slug = workload.replace("-", "_")
        files = [plot_ttft(rows, f"{workload}: TTFT per policy vs cluster size", output / f"{slug}_ttft.png"),
                 plot_hit_rate(rows, f"{workload}: prefix-cache hit rate vs cluster size",
                               output / f"{slug}_hit_rate.png")]
        if cdfs.get(workload):
            files.append(plot_cdf(cdfs[workload], output / f"{slug}_ttft_cdf_{CDF_WORKERS}.png"))
        plots[workload] = [f.name for f in files]
    return plots
