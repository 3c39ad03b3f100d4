"""Recent pulls of a consumer engine, kept so the worker can report each request's transfer.

vLLM suffixes request ids internally ("r1" runs as "r1-9383ce2a"), so a lookup by
kvroute's id matches that id followed by a dash.
"""

from __future__ import annotations

import threading
from collections import deque

from foundation.wire import PullRecord

CAPACITY = 1024  # far more than the requests in flight on one engine


class PullRecords:
    """Pull threads add; the transfer endpoint's thread reads."""

    def __init__(self, capacity: int = CAPACITY):
        self._records: deque[PullRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def add(self, record: PullRecord) -> None:
        with self._lock:
            self._records.append(record)

    def matching(self, request_id: str) -> list[PullRecord]:
        with self._lock:
            return [r for r in self._records
                    if r.request_id == request_id or r.request_id.startswith(request_id + "-")]
