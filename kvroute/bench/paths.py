"""Where measurements find their inputs and put their results by default."""

from __future__ import annotations

from pathlib import Path

# The checkout (kvroute runs from it, installed in development mode).
REPO_ROOT = Path(__file__).resolve().parents[2]
# The Mooncake synthetic trace, beside the checkout (``workloads.trace``).
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def results_path(output: Path) -> Path:
    """``output`` itself when it names a .json file, else ``output/results.json``."""
    return output if output.suffix == ".json" else output / "results.json"
