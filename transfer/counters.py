"""Transfer counters shared by the block server and the puller of one engine."""

from __future__ import annotations

import threading

from foundation.wire import LinkMeasurement, TransferCounters

KEPT_MEASUREMENTS = 8  # the latest link choices by measurement shown in the counters


class Counters:
    """Monotonic counters; many threads add, ``snapshot`` reads them consistently."""

    def __init__(self):
        self._values = TransferCounters()
        self._lock = threading.Lock()

    def add(self, **increments: int) -> None:
        with self._lock:
            for name, amount in increments.items():
                setattr(self._values, name, getattr(self._values, name) + amount)

    def record_measurement(self, measurement: LinkMeasurement) -> None:
        """A link whose backend was chosen by measurement: counted, and kept among the latest."""
        with self._lock:
            self._values.links_measured += 1
            kept = [*self._values.link_measurements, measurement]
            self._values.link_measurements = kept[-KEPT_MEASUREMENTS:]

    def snapshot(self, **current: int) -> TransferCounters:
        """A copy of the counters, with gauges (``active_leases`` …) filled in."""
        with self._lock:
            values = TransferCounters(**{f: getattr(self._values, f) for f in self._values.__struct_fields__})
            values.link_measurements = list(values.link_measurements)
        for name, value in current.items():
            setattr(values, name, value)
        return values
