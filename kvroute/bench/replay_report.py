"""The terminal table of a replay's per-policy summaries (``replay_results.summarize``)."""

from __future__ import annotations

from rich.table import Table


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def summary_table(summaries: dict[str, dict], labels: list[str], title: str) -> Table:
    """One row per policy; the last column counts the requests each worker in ``labels`` prefilled."""
    table = Table(title=f"{title} (times in ms)")
    for column in ("policy", "ok/err", "hit rate", "TTFT p50", "TTFT p99", "2nd p50", "2nd p99", "ITL mean",
                   "E2E p50", "E2E p99", "LOCAL", "prefills " + "/".join(labels)):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, s in summaries.items():
        counts = s["prefilling_worker_counts"]
        table.add_row(
            name, f"{s['succeeded']}/{s['errors']}", "-" if s["hit_rate"] is None else f"{s['hit_rate']:.1%}",
            ms(s["ttft_p50_s"]), ms(s["ttft_p99_s"]), ms(s["second_token_p50_s"]), ms(s["second_token_p99_s"]),
            ms(s["itl_mean_s"]), ms(s["e2e_p50_s"]), ms(s["e2e_p99_s"]), str(s["plan_kinds"].get("local", 0)),
            "/".join(str(counts.get(label, 0)) for label in labels))
    return table
