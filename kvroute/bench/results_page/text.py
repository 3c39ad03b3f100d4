"""Markdown pieces of the results page: cells, lists, tables and verdicts."""

from __future__ import annotations


def cell(value, kind: str = "s") -> str:
    """Seconds and ratios to two decimals ("s", "x"), shares as percentages ("%")."""
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if kind == "%" else f"{value:.2f}"


def listing(items: list[str]) -> str:
    return " and ".join(filter(None, [", ".join(items[:-1]), items[-1]])) if items else ""


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(item) for item in row) + " |" for row in rows])


def verdict(judged: dict) -> str:
    return f"{cell(judged['value'], judged['kind'])} {'PASS' if judged['pass'] else 'MISS'}"
