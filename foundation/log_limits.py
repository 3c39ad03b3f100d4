"""Warnings about what peers send, at most one per peer per interval.

A peer that sends garbage in a loop must not be able to fill the log (or spend the
process's time formatting lines): the first warning about a peer is logged, later ones
within ``interval_seconds`` are counted and the count is told with the next one logged.
At most ``max_peers`` peers are remembered (``foundation.lru``), so a flood of distinct
peers costs bounded memory; a forgotten peer is warned about again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from foundation.lru import LruDict

DEFAULT_INTERVAL_SECONDS = 10.0
DEFAULT_MAX_PEERS = 1024


@dataclass
class _PeerRecord:
    last_logged: float
    suppressed: int = 0


class PeerWarnings:
    """Owned by one thread or event loop (no lock)."""

    def __init__(self, logger: logging.Logger, interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
                 max_peers: int = DEFAULT_MAX_PEERS, clock=time.monotonic):
        self._logger = logger
        self._interval = interval_seconds
        self._clock = clock
        self._peers: LruDict[str, _PeerRecord] = LruDict(max_peers)

    def warn(self, peer: str, message: str, *args) -> bool:
        """Log ``message % args`` about ``peer`` unless one was logged in the interval; True if logged."""
        now = self._clock()
        record = self._peers.get(peer)
        if record is not None and now - record.last_logged < self._interval:
            record.suppressed += 1
            return False
        suppressed = record.suppressed if record is not None else 0
        self._peers[peer] = _PeerRecord(now)
        tail = f" ({suppressed} more from this peer in the last {self._interval:.0f} s)" if suppressed else ""
        self._logger.warning("from %s: " + message + "%s", peer, *args, tail)
        return True
