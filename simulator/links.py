"""KV transfers between workers: latency plus bytes over the destination's link, in turn.

A decode worker's network interface is the shared resource: transfers into one worker
go one after another (first come, first served), each taking ``bytes / bandwidth`` of
the link, and arrive ``latency`` after their last byte left. Transfers into different
workers do not slow each other. Single writer: the simulation loop.
"""

from __future__ import annotations

from simulator.calibration import SimCalibration


class Links:
    def __init__(self, calibration: SimCalibration):
        self.calibration = calibration
        self._busy_until: dict[str, float] = {}  # destination → when its link is free again

    def transfer(self, destination: str, num_bytes: int, now: float) -> float:
        """Start moving ``num_bytes`` into ``destination`` at ``now``; when they have all arrived."""
        if num_bytes <= 0:
            return now
        start = max(now, self._busy_until.get(destination, now))
        self._busy_until[destination] = start + self.calibration.transfer_seconds(num_bytes)
        return self._busy_until[destination] + self.calibration.link_latency_seconds
