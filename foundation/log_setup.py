"""One log line format for every kvroute process, and kvroute's lines in processes it does not start.

vLLM starts the engine core and its workers itself, where kvroute's connector runs; their root
logger has no handler, so the connector's INFO lines (its endpoint, its staging arena) went
nowhere. ``show_kvroute_logs`` gives the ``kvroute`` loggers a handler there, on standard
error, which the worker's log file collects with vLLM's own lines.
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def show_kvroute_logs(level: int = logging.INFO) -> None:
    """Log kvroute's lines at ``level`` to standard error, unless this process already logs them."""
    kvroute = logging.getLogger("kvroute")
    if kvroute.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    kvroute.addHandler(handler)
    kvroute.setLevel(level)
