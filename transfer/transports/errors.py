"""How a link fails. Every failure closes the link it happened on (see ``base``)."""

from __future__ import annotations

import time


class TransportError(RuntimeError):
    """A link failed; it is closed, and the pair must open a new one."""


class TransportTimeout(TransportError, TimeoutError):
    """The deadline passed: the peer is dead, stuck, or was never there."""


class PeerLost(TransportError):
    """The peer closed the link or its process went away."""


class FrameMismatch(TransportError):
    """The peer sent something other than what this end expected (sizes, id, order)."""


class LinkRefused(TransportError):
    """The two ends cannot agree on how to connect (backend, device, roles)."""


class LinkClosed(TransportError):
    """The link was closed, by its owner or by an earlier failure."""


def seconds_left(deadline: float, waiting_for: str) -> float:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value); raises once it has passed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransportTimeout(f"deadline passed waiting for {waiting_for}")
    return remaining
