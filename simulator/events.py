"""The simulation clock: a priority queue of timed events that never runs backwards.

Events at the same time come out in the order they were scheduled (a sequence number
breaks ties), so a run is deterministic. Each event is a callback and its arguments.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class TimeWentBackwards(AssertionError):
    pass


class EventQueue:
    def __init__(self):
        self.now = 0.0
        self.num_processed = 0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._sequence = 0

    def at(self, time: float, callback: Callable[..., None], *args: Any) -> None:
        if time < self.now:
            raise TimeWentBackwards(f"event scheduled at {time} while the clock is at {self.now}")
        heapq.heappush(self._heap, (time, self._sequence, callback, args))
        self._sequence += 1

    def run(self, settled: Callable[[], bool] | None = None, check_every: int = 1) -> bool:
        """Process events in time order until none are left, or until ``settled()`` (asked
        every ``check_every`` events) says the rest need not run; whether it stopped early."""
        while self._heap:
            if settled is not None and self.num_processed % check_every == 0 and self.num_processed and settled():
                return True
            time, _, callback, args = heapq.heappop(self._heap)
            if time < self.now:
                raise TimeWentBackwards(f"event at {time} popped after {self.now}")
            self.now = time
            self.num_processed += 1
            callback(*args)
        return False
