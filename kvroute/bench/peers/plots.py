"""PNG plots of a peers sweep, each written to the path it is given (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from kvroute.bench.replay_plots import DPI  # noqa: E402

PANELS = (("ttft_p50_s", "TTFT P50 (ms)"), ("ttft_p99_s", "TTFT P99 (ms)"), ("tpot_p50_s", "TPOT P50 (ms)"))


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


def latency_vs_rate(metrics: dict[str, dict[str, dict[float, dict]]], path: Path) -> Path:
    """A column per workload, a row per latency; a line per system over the swept rates."""
    workloads = sorted({w for per_system in metrics.values() for w in per_system})
    figure, axes = plt.subplots(len(PANELS), max(len(workloads), 1), figsize=(4.5 * max(len(workloads), 1), 9),
                                squeeze=False)
    for column, workload in enumerate(workloads):
        for row, (key, label) in enumerate(PANELS):
            axis = axes[row, column]
            for system, per_workload in metrics.items():
                runs = per_workload.get(workload, {})
                rates = sorted(rate for rate in runs if runs[rate].get(key) is not None)
                if rates:
                    axis.plot(rates, [runs[r][key] * 1000 for r in rates], marker="o", label=system)
            axis.set_title(workload if row == 0 else "")
            axis.set_xlabel("request rate (req/s)")
            axis.set_ylabel(label)
            axis.grid(True, alpha=0.3)
            if axis.get_legend_handles_labels()[0]:
                axis.legend(fontsize="small")
    figure.suptitle("Latency against request rate, per system")
    return _save(figure, path)


def goodput_bars(comparisons: dict, path: Path, attainment: float = 0.9) -> Path:
    """Per workload, a bar per system: its goodput (0 where no swept rate met the bar)."""
    workloads = list(comparisons)
    systems = sorted({s for c in comparisons.values() for s in c["goodput"]["values"]})
    figure, axis = plt.subplots(figsize=(max(6, 2.2 * len(workloads)), 4.5))
    width = 0.8 / max(len(systems), 1)
    positions = np.arange(len(workloads))
    for k, system in enumerate(systems):
        values = [comparisons[w]["goodput"]["values"].get(system) or 0 for w in workloads]
        bars = axis.bar(positions + (k - (len(systems) - 1) / 2) * width, values, width, label=system)
        axis.bar_label(bars, fmt="%g", fontsize="small")
    axis.set_xticks(positions, workloads)
    axis.set_ylabel("goodput (req/s)")
    axis.set_title(f"Goodput: largest swept rate with >= {attainment:.0%} of requests within both targets")
    axis.legend(fontsize="small")
    return _save(figure, path)
