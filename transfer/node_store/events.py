"""The node store's record of what it stored and removed, numbered, for the orchestrators'
indexes (``orchestrator.tier_holdings``).

Every event gets the next sequence number of the store's run (``epoch``: random per
process, so a restarted store is never mistaken for the one before). A reader asks for the
events after the last it applied; the log keeps the latest ``MAX_EVENTS``, and a reader
that fell further behind, or knew another epoch, is sent everything the store holds
instead (a snapshot), as a worker's index sync reloads a snapshot after a gap.
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass
from itertools import islice

MAX_EVENTS = 65536  # kept for readers; one that is further behind gets a snapshot


@dataclass(frozen=True)
class StoreEvent:
    kind: str  # "stored" or "removed"
    key: bytes
    tier: str  # "host" or "disk" (``transfer.node_store.index.Tier``)


class EventLog:
    def __init__(self, max_events: int = MAX_EVENTS):
        self.epoch = secrets.token_hex(8)
        self.seq = 0  # of the latest event; 0: none yet
        self._events: deque[StoreEvent] = deque(maxlen=max_events)

    def append(self, *events: StoreEvent) -> None:
        self._events.extend(events)
        self.seq += len(events)

    def since(self, epoch: str, seq: int) -> list[StoreEvent] | None:
        """The events after ``seq`` of run ``epoch``, oldest first; None when they are not
        all kept (another run, or too old): the reader needs a snapshot."""
        if epoch != self.epoch or seq > self.seq or self.seq - seq > len(self._events):
            return None
        return list(islice(self._events, len(self._events) - (self.seq - seq), None))
