"""The terminal report of a peers sweep: a table per workload, the verdicts under it, and goodput.

Every verdict line names the winner of its metric, a peer included (``report.verdict``).
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvroute.bench.peers import report
from kvroute.bench.peers.run import Sweep

COLUMNS = ("system", "rate", "ok/err/lost", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50", "hit rate",
           "SLO met")


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def workload_table(sweep: Sweep, workload: str, targets: report.Targets) -> Table:
    table = Table(title=f"{workload} (times in ms; SLO: TTFT <= {targets.ttft_s:g} s and TPOT <= "
                        f"{targets.tpot_s:g} s)")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "system" else "right")
    for record in sweep.systems:
        runs = [r for r in record.runs if r.workload == workload]
        if record.skipped and not runs:
            table.add_row(record.system, "", "skipped", *[""] * (len(COLUMNS) - 4), "(why: below)")
            continue
        for run in runs:  # a system that stopped running later still shows what it measured
            m = run.metrics
            table.add_row(record.system, f"{run.rate:g}", f"{m['succeeded']}/{m['errors']}/{m['lost']}",
                          ms(m["ttft_p50_s"]), ms(m["ttft_p99_s"]), ms(m["tpot_p50_s"]), ms(m["tpot_p99_s"]),
                          ms(m["e2e_p50_s"]), report.fmt(m["hit_rate"], "%"), f"{m['slo_attainment']:.0%}")
    return table


def goodput_table(comparisons: dict, targets: report.Targets) -> Table:
    table = Table(title=f"Goodput: the largest swept rate with >= {targets.attainment:.0%} of requests within "
                        "both targets (req/s)")
    table.add_column("workload")
    systems = sorted({s for c in comparisons.values() for s in c["goodput"]["values"]})
    for system in systems:
        table.add_column(system, justify="right")
    table.add_column("winner")
    for workload, comparison in comparisons.items():
        values = comparison["goodput"]["values"]
        table.add_row(workload, *(report.fmt(values.get(s), "rps").removesuffix(" req/s") for s in systems),
                      " and ".join(comparison["goodput"]["winners"]) or "none met the bar")
    return table


def verdict_lines(comparison: dict) -> list[str]:
    """One line per metric and rate, then the goodput line."""
    lines = []
    for rate, per_metric in comparison["rates"].items():
        lines += [f"@{rate:g}/s  {c['verdict']}" for c in per_metric.values()]
    lines.append(comparison["goodput"]["verdict"])
    return lines


def print_report(console: Console, sweep: Sweep, comparisons: dict, targets: report.Targets) -> None:
    for workload, comparison in comparisons.items():
        console.print(workload_table(sweep, workload, targets))
        for line in verdict_lines(comparison):
            console.print(f"  {line}", highlight=False)
    if comparisons:
        console.print(goodput_table(comparisons, targets))
    for record in sweep.systems:
        if record.skipped:
            console.print(f"[yellow]{record.system} skipped: {record.skipped}[/]", highlight=False)
