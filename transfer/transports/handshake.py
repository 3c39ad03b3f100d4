"""First contact on a link: both ends describe themselves, then the sender says where to connect.

::

    sender                                   receiver
      ── LinkHello(layout, device, host…) ──▶
      ◀── LinkHello(layout, device, host…) ──
      both: layouts equal? same backend choice?   (else both raise, nothing is bound)
      ── LinkSetup(backend, address) ─────────▶ join(address)

The layout check happens on both ends, so neither side ever moves a byte between
caches that would read it differently.
"""

from __future__ import annotations

import os
import socket
from typing import Union

import msgspec

from kvroute.wire import KVLayoutSpec
from transfer.kv_layout import LayoutMismatch
from transfer.transports.control import ControlChannel
from transfer.transports.errors import LinkRefused

SENDER, RECEIVER = "sender", "receiver"


class _HandshakeMessage(msgspec.Struct, tag_field="type", forbid_unknown_fields=False):
    pass


class LinkHello(_HandshakeMessage, tag="link_hello"):
    role: str  # SENDER or RECEIVER
    layout: KVLayoutSpec
    device: str  # "cpu" or "cuda": where this end's frames live
    host_id: str  # equal on two ends that can share an ipc socket (see ``host_identity``)
    backends: list[str]  # the backends this end can run
    requested: str = "auto"  # this end's override, if any


class LinkSetup(_HandshakeMessage, tag="link_setup"):
    backend: str
    address: str = ""
    error: str = ""  # set when the sender could not host; the receiver fails at once


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Union[LinkHello, LinkSetup])


def encode(message: _HandshakeMessage) -> bytes:
    return _encoder.encode(message)


def receive(control: ControlChannel, kind: type, deadline: float):
    """The next control message, which must be a ``kind``."""
    try:
        message = _decoder.decode(control.receive_bytes(deadline))
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise LinkRefused(f"malformed first-contact message: {error}") from error
    if not isinstance(message, kind):
        raise LinkRefused(f"expected {kind.__name__} at first contact, got {type(message).__name__}")
    return message


def exchange_hellos(control: ControlChannel, local: LinkHello, deadline: float) -> LinkHello:
    """Send ours, read theirs, and check the two can form a link at all."""
    control.send_bytes(encode(local))
    remote = receive(control, LinkHello, deadline)
    if remote.role == local.role:
        raise LinkRefused(f"both ends of the link are {local.role}s")
    check_layouts(local.layout, remote.layout)
    return remote


def layout_differences(local: KVLayoutSpec, remote: KVLayoutSpec) -> list[str]:
    """Each field in which two layouts differ, as 'field: local …, remote …'."""
    return [f"{field}: local {getattr(local, field)!r}, remote {getattr(remote, field)!r}"
            for field in local.__struct_fields__ if getattr(local, field) != getattr(remote, field)]


def check_layouts(local: KVLayoutSpec, remote: KVLayoutSpec) -> None:
    differences = layout_differences(local, remote)
    if differences:
        # block_shape holds the heads, block size and head size in the engine's own order.
        raise LayoutMismatch("KV cache layouts differ, refusing the link: " + "; ".join(differences))


def host_identity() -> str:
    """Equal for two processes on one running machine with one host name.

    The boot id alone would match containers sharing a kernel but not a file system; the
    host name alone would match two machines named alike. ipc socket files also need a
    directory both ends see, which one host name and one boot usually mean."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot_id = file.read().strip()
    except OSError:
        boot_id = f"pid-namespace-{os.getpid()}"  # unknown boot: only this process matches
    return f"{socket.gethostname()}/{boot_id}"
