"""The transfer benchmark's table (rich) and plot (matplotlib), from its results document."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from rich.console import Console
from rich.table import Table

PLOT_NAME = "transfer_vs_recompute.png"
_COLORS = {"zmq-tcp": "tab:blue", "zmq-ipc": "tab:green", "gloo": "tab:orange", "nccl": "tab:red",
           "nixl": "tab:purple"}


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f}"


def results_table(results: Mapping) -> Table:
    table = Table(title="KV transfer vs recompute (medians; ratio = raw s / backend s)")
    for column in ("link", "tokens", "MB", "backend", "transfer ms", "raw ms", "baseline", "ratio",
                   "recompute ms", "faster"):
        table.add_column(column, justify="left" if column in ("link", "backend", "baseline", "faster") else "right")
    for row in results["results"]:
        transfer = _ms(row["transfer_seconds"]) + ("" if row["measured"] else " (predicted)")
        ratio = "—" if row["ratio_vs_raw"] is None else f"{row['ratio_vs_raw']:.2f}"
        table.add_row(row["link"], str(row["prompt_tokens"]), f"{row['bytes'] / 1e6:.1f}", row["backend"],
                      transfer, _ms(row["raw_baseline_seconds"]), row["raw_baseline"] or "—", ratio,
                      _ms(row["recompute_seconds"]), row["faster"] or "—")
    return table


def checksum_table(results: Mapping) -> Table:
    table = Table(title="per-frame checksums (medians; on/off ratio = seconds without / seconds with)")
    for column in ("link", "tokens", "MB", "backend", "off ms", "on ms", "on/off ratio", "cost"):
        table.add_column(column, justify="left" if column in ("link", "backend") else "right")
    for row in results["results"]:
        if row.get("checksum_seconds") is not None:
            table.add_row(row["link"], str(row["prompt_tokens"]), f"{row['bytes'] / 1e6:.1f}", row["backend"],
                          _ms(row["transfer_seconds"]), _ms(row["checksum_seconds"]), f"{row['checksum_ratio']:.2f}",
                          f"{row['checksum_seconds'] / row['transfer_seconds'] - 1:+.1%}")
    return table


def crossover_table(results: Mapping) -> Table:
    table = Table(title="crossover: prompt length where transfer and recompute take equally long")
    for column in ("link", "backend", "crossover tokens", "transfer faster at", "recompute faster at"):
        table.add_column(column)
    for series in results["crossovers"]:
        crossings = ", ".join(f"~{c['prompt_tokens']} ({c['between'][0]}–{c['between'][1]}"
                              f"{', predicted' if c['predicted'] else ''})"
                              for c in series["crossings"]) or "none in the sweep"
        table.add_row(series["link"], series["backend"], crossings,
                      _lengths(series["transfer_faster_at"]), _lengths(series["recompute_faster_at"]))
    return table


def _lengths(lengths: list[int]) -> str:
    return ", ".join(map(str, lengths)) or "—"


def estimates_table(results: Mapping) -> Table:
    table = Table(title="link estimates (LinkCalibrator over the measured transfers)")
    for column in ("source → destination", "bandwidth MB/s", "latency ms"):
        table.add_column(column, justify="left" if column.startswith("source") else "right")
    for row in results["link_estimates"]:
        table.add_row(f"{row['source']} → {row['destination']}", f"{row['bandwidth_bytes_per_second'] / 1e6:.1f}",
                      f"{row['latency_seconds'] * 1e3:.2f}")
    return table


def encryption_table(results: Mapping) -> Table:
    table = Table(title="transfer encryption (medians; cost = encrypted s / clear s; vs raw = raw pyzmq s / link s)")
    for column in ("backend", "tokens", "MB", "encrypted ms", "clear ms", "raw pyzmq ms", "cost", "encrypted vs raw",
                   "clear vs raw"):
        table.add_column(column, justify="left" if column == "backend" else "right")
    for row in results["encryption"]:
        table.add_row(row["backend"], str(row["prompt_tokens"]), f"{row['bytes'] / 1e6:.1f}",
                      f"{row['encrypted_ms']:.1f}", f"{row['clear_ms']:.1f}", f"{row['raw_ms']:.1f}",
                      f"{row['encryption_cost']:.2f}x", f"{row['encrypted_vs_raw']:.2f}", f"{row['clear_vs_raw']:.2f}")
    return table


def into_cache_table(results: Mapping) -> Table:
    rows = results["into_cache"]
    paths = list(dict.fromkeys(row["path"] for row in rows))
    table = Table(title="a staged lease pulled into a paged cache (medians, ms; x = shared-copy s / path s)")
    for column in ("tokens", "MB", *paths):
        table.add_column(column, justify="right")
    by_size: dict[int, dict[str, float]] = {}
    for row in rows:
        by_size.setdefault(row["prompt_tokens"], {"bytes": row["bytes"]})[row["path"]] = row["seconds"]
    for tokens, measured in by_size.items():
        shared = measured.get("shared")
        cells = [f"{_ms(measured[path])}" + (f", {shared / measured[path]:.2f}x" if shared else "")
                 if path in measured else "—" for path in paths]
        table.add_row(str(tokens), f"{measured['bytes'] / 1e6:.1f}", *cells)
    return table


def print_report(results: Mapping, console: Console) -> None:
    console.print(results_table(results))
    if any(row.get("checksum_seconds") is not None for row in results["results"]):
        console.print(checksum_table(results))
    if results["crossovers"]:
        console.print(crossover_table(results))
    console.print(estimates_table(results))
    if results.get("encryption"):
        console.print(encryption_table(results))
    if results.get("into_cache"):
        console.print(into_cache_table(results))


def plot(results: Mapping, path: Path) -> Path:
    """One panel per link: transfer per backend (solid), its raw baseline (dashed), transfer
    predicted from the link's estimate where the link skipped a length (hollow, dotted),
    recompute (black), and a dotted vertical line at each crossover."""
    import matplotlib

    matplotlib.use("Agg")  # no display; the benchmark only writes the file
    import matplotlib.pyplot as plt

    links = [link["name"] for link in results["links"]]
    figure, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links), 4.5), squeeze=False, sharex=True, sharey=True)
    for axis, link in zip(axes[0], links):
        _plot_link(axis, link, results)
    axes[0][0].set_ylabel("seconds (median)")
    figure.suptitle(f"KV transfer vs recompute, {results['layout']['bytes_per_token']:,} B/token "
                    f"({results['layout']['dtype']}, {results['layout']['source']})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _plot_link(axis, link: str, results: Mapping) -> None:
    rows = [row for row in results["results"] if row["link"] == link]
    for backend in sorted({row["backend"] for row in rows}):
        series = [row for row in rows if row["backend"] == backend]
        measured = [row for row in series if row["measured"]]
        color = _COLORS.get(backend)
        axis.plot([row["prompt_tokens"] for row in measured], [row["transfer_seconds"] for row in measured],
                  "o-", color=color, label=backend)
        axis.plot([row["prompt_tokens"] for row in measured], [row["raw_baseline_seconds"] for row in measured],
                  "--", color=color, alpha=0.6, label=measured[0]["raw_baseline"])
        if len(measured) < len(series):  # the skipped lengths, from the link's estimate
            axis.plot([row["prompt_tokens"] for row in series], [row["transfer_seconds"] for row in series],
                      ":", marker="o", fillstyle="none", color=color, alpha=0.7, label=f"{backend} (predicted)")
    recompute = results.get("recompute") or {}
    if recompute:
        lengths = sorted(int(tokens) for tokens in recompute)
        axis.plot(lengths, [recompute[str(n)]["median"] for n in lengths], "s-", color="black", label="recompute")
    for series in results["crossovers"]:
        if series["link"] == link:
            for crossing in series["crossings"]:
                axis.axvline(crossing["prompt_tokens"], color=_COLORS.get(series["backend"]), linestyle=":")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("prompt tokens")
    axis.set_title(link)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=7)
