"""Where kvroute keeps what it computes once per machine (prepared models, file hashes)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$KVROUTE_CACHE_DIR, else ~/.cache/kvroute; overridable so tests and containers can redirect it."""
    env = os.environ.get("KVROUTE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvroute"
