"""Text checks of the workload generators' tests."""

from __future__ import annotations


def shares_substring(a: str, b: str, length: int) -> str | None:
    """A substring of ``length`` characters found in both, or None."""
    windows = {a[i:i + length] for i in range(len(a) - length + 1)}
    return next((b[i:i + length] for i in range(len(b) - length + 1) if b[i:i + length] in windows), None)
