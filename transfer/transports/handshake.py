"""First contact on a link: both ends describe themselves, then the sender says where to connect.

::

    sender                                   receiver
      ── LinkHello(layout, device, host…) ──▶
      ◀── LinkHello(layout, device, host…) ──
      both: layouts equal? same backend choice?   (else both raise, nothing is bound)
      ── LinkSetup(backend, address) ─────────▶ join(address)

The layout check happens on both ends, so neither side ever moves a byte between
caches that would read it differently. The messages are ``foundation.wire`` types, so
their encoding is pinned by the same golden payloads as every other message.
"""

from __future__ import annotations

from foundation import wire
from foundation.wire import LinkHello, LinkSetup
from transfer.kv_layout import check_layouts
from transfer.transports.control import ControlChannel
from transfer.transports.errors import LinkRefused

SENDER, RECEIVER = "sender", "receiver"


def send(control: ControlChannel, message: LinkHello | LinkSetup) -> None:
    control.send_bytes(wire.encode(message))


def receive(control: ControlChannel, kind: type, deadline: float):
    """The next control message, which must be a ``kind``."""
    try:
        message = wire.decode(control.receive_bytes(deadline))
    except wire.WireError as error:
        raise LinkRefused(f"malformed first-contact message: {error}") from error
    if not isinstance(message, kind):
        raise LinkRefused(f"expected {kind.__name__} at first contact, got {type(message).__name__}")
    return message


def exchange_hellos(control: ControlChannel, local: LinkHello, deadline: float) -> LinkHello:
    """Send ours, read theirs, and check the two can form a link at all."""
    send(control, local)
    remote = receive(control, LinkHello, deadline)
    if remote.role == local.role:
        raise LinkRefused(f"both ends of the link are {local.role}s")
    check_layouts(local.layout, remote.layout, refusing="the link")
    return remote
