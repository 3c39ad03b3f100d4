"""Whether loopback port shaping (``kvroute.bench.shaped_port``) works here: it needs root and
tc with htb. Asked once, on import, by the tests that shape a port."""

from __future__ import annotations

from kvroute.bench.shaped_port import ShapedPort
from kvroute.bench.transfer_netns import ShapingUnavailable, shaping_available


def probe(rate: str = "20mbit") -> str | None:
    """None where a port can be shaped; otherwise why not."""
    reason = shaping_available()
    if reason:
        return reason
    try:
        with ShapedPort(1, rate):
            return None
    except ShapingUnavailable as error:
        return str(error)


UNAVAILABLE = probe()
