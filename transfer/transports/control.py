"""The control channel a link's first contact runs over, supplied by the caller.

A link's two ends exchange a few small messages before any payload moves (see
``handshake``): their layouts, the backend, and the address to connect to. Where those
travel is the caller's business: between engines, the existing transfer endpoint
connection; in tests and benchmarks, a ``multiprocessing`` pipe.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Protocol

from transfer.transports.errors import PeerLost, TransportTimeout, seconds_left


class ControlChannel(Protocol):
    """Ordered, reliable delivery of whole messages to the one peer of a link."""

    def send_bytes(self, payload: bytes) -> None: ...

    def receive_bytes(self, deadline: float) -> bytes:
        """The next message; TransportTimeout at ``deadline``, PeerLost if the peer went away."""
        ...


class ConnectionChannel:
    """A ControlChannel over one end of ``multiprocessing.Pipe()`` (works across threads too)."""

    def __init__(self, connection: Connection):
        self._connection = connection

    def send_bytes(self, payload: bytes) -> None:
        try:
            self._connection.send_bytes(payload)
        except (BrokenPipeError, ConnectionResetError, OSError) as error:
            raise PeerLost(f"control channel closed: {error}") from error

    def receive_bytes(self, deadline: float) -> bytes:
        if not self._connection.poll(seconds_left(deadline, "a control message")):
            raise TransportTimeout("no control message from the peer before the deadline")
        try:
            return self._connection.recv_bytes()
        except (EOFError, ConnectionResetError, OSError) as error:
            raise PeerLost("the peer closed the control channel") from error
