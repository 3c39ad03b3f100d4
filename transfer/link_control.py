"""Transport links between engines, opened over the transfer endpoint's own connection.

By default a pull's layers come back as frames on the connection that asked for them
(``block_server``). With a link (``ConnectorSettings.transfer_link``) they travel over a
``transfer.transports`` link instead: ZeroMQ tcp/ipc, or a torch.distributed pair group
(Gloo for host caches, NCCL for CUDA caches). A consumer opens one link per producer, on
its first pull from it::

    consumer (receiver)                              producer's block server (sender)
      DEALER ── OpenLink(link_id, our LinkHello) ──▶ ROUTER
             ◀── its LinkHello ───────────────────
             ◀── LinkSetup(backend, address) ─────   hosts the link, keeps it by link_id
      joins the backend at address
      PullOverLink(handle, blocks, link_id, n) ───▶ PullHeader(ok) back on the DEALER,
                                                    the layers over link_id as transfer n

Both ends compare layouts and pick the backend with the transports' own handshake
(``transfer.transports.links``), so a mismatch refuses the link before a byte moves. A
link that fails is closed on both ends; the consumer's next pull opens a new one.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field

import torch
import zmq

from foundation import wire
from foundation.endpoint_client import ChannelPool, PullFailed
from foundation.zmq_auth import secure_client
from transfer.block_client import LayerSink, pull_exchange
from transfer.kv_layout import LayoutMismatch
from transfer.link_names import ENDPOINT, LINK_CHOICES
from transfer.pull_check import CorruptFrame
from transfer.transports.base import Receiver
from transfer.transports.checksums import ChecksumMismatch
from transfer.transports.errors import TransportError, TransportTimeout, seconds_left
from transfer.transports.links import open_receiver
from transfer.transports.settings import TransportSettings

LINK_OPEN_SECONDS = 10.0


class ProducerControl:
    """The producer's side of a link's first contact: replies go to one ROUTER peer. The
    consumer's hello came with ``OpenLink``; what the consumer says later (its ``LinkChoice``,
    when the backend is chosen by measurement) comes as another ``OpenLink`` of the same
    link id on the same socket. Other messages that arrive meanwhile are kept, in order, in
    ``deferred`` (identity frame, message frames) for the server to handle afterwards."""

    def __init__(self, socket: zmq.Socket, identity: bytes, link_id: str, hello: bytes):
        self._socket, self._identity, self._link_id = socket, identity, link_id
        self._unread = [hello]
        self.deferred: list[tuple[zmq.Frame, list[zmq.Frame]]] = []

    def send_bytes(self, payload: bytes) -> None:
        self._socket.send_multipart([self._identity, payload])

    def receive_bytes(self, deadline: float) -> bytes:
        if self._unread:
            return self._unread.pop()
        while self._socket.poll(int(seconds_left(deadline, "the consumer's link message") * 1000) + 1):
            identity, *frames = self._socket.recv_multipart(copy=False)
            payload = self._ours(identity, frames)
            if payload is not None:
                return payload
            self.deferred.append((identity, frames))
        raise TransportTimeout("the consumer did not continue the link's first contact before the deadline")

    def _ours(self, identity: zmq.Frame, frames: list[zmq.Frame]) -> bytes | None:
        """The payload of an OpenLink of this link from this consumer; None for anything else."""
        if identity.bytes != self._identity or len(frames) != 1:
            return None
        try:
            message = wire.decode(frames[0].buffer)
        except wire.WireError:
            return None
        if isinstance(message, wire.OpenLink) and message.link_id == self._link_id:
            return message.payload
        return None


class ConsumerControl:
    """The consumer's side: its hello goes out wrapped in ``OpenLink``; the answers are
    read from the same DEALER connection."""

    def __init__(self, socket: zmq.Socket, link_id: str):
        self._socket, self._link_id = socket, link_id

    def send_bytes(self, payload: bytes) -> None:
        self._socket.send(wire.encode(wire.OpenLink(link_id=self._link_id, payload=payload)))

    def receive_bytes(self, deadline: float) -> bytes:
        if not self._socket.poll(int(seconds_left(deadline, "the producer's link answer") * 1000) + 1):
            raise TransportTimeout("the producer did not answer the link's first contact before the deadline")
        return self._socket.recv()


def host_of(address: str) -> str:
    """The host of ``tcp://HOST:PORT``: where a link to or from this endpoint binds."""
    return address.removeprefix("tcp://").rsplit(":", 1)[0]


def transport_settings(choice: str, address: str) -> TransportSettings:
    """A link end's settings: ``choice`` is "auto" or a backend; links bind on ``address``'s host."""
    if choice not in LINK_CHOICES or choice == ENDPOINT:
        raise ValueError(f"a link's backend must be one of {list(LINK_CHOICES[1:])}, got {choice!r}")
    return TransportSettings(backend=choice, host=host_of(address))


@dataclass
class ConsumerLink:
    """One open link to a producer. Its lock spans a pull's request and its receive, so
    the producer sends transfers in the order this end receives them."""

    link_id: str
    receiver: Receiver
    lock: threading.Lock = field(default_factory=threading.Lock)
    _transfer_ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    @property
    def closed(self) -> bool:
        return self.receiver.closed

    def next_transfer_id(self) -> int:
        return next(self._transfer_ids)

    def close(self) -> None:
        self.receiver.close()


def open_consumer_link(context: zmq.Context, address: str, layout: wire.KVLayoutSpec, device: torch.device,
                       settings: TransportSettings, timeout: float = LINK_OPEN_SECONDS) -> ConsumerLink:
    """Open a link from the producer at ``address`` to this consumer; raises PullFailed."""
    link_id = secrets.token_hex(16)
    socket = secure_client(context.socket(zmq.DEALER), "worker", transfer=True)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    try:
        receiver = open_receiver(ConsumerControl(socket, link_id), layout, device, time.monotonic() + timeout,
                                 settings, zmq_context=context)
    except (TransportError, LayoutMismatch, wire.WireError) as error:
        raise PullFailed(f"could not open a {settings.backend} link from {address}: {error}") from error
    finally:
        socket.close(linger=0)
    return ConsumerLink(link_id, receiver)


def pull_over_link(context: zmq.Context, source: wire.PullSource, block_indices: list[int],
                   layout: wire.KVLayoutSpec, link: ConsumerLink, on_layer: LayerSink, deadline: float,
                   channels: ChannelPool | None = None, checksum: bool = False) -> int:
    """``block_client.pull_blocks`` with the layers over ``link``; raises PullFailed
    (PullRefused, CorruptFrame: as ``pull_blocks``).

    Any failure closes the link, a refusal too: frames of a failed transfer may still be
    in flight, and a producer that no longer knows the link (it restarted, or closed it
    after a failed send) would refuse every later pull on it. The next pull opens a new one."""
    with link.lock:
        transfer_id = link.next_transfer_id()
        request = wire.PullOverLink(handle=source.handle, block_indices=list(block_indices), layout=layout,
                                    link_id=link.link_id, transfer_id=transfer_id, checksum=checksum)
        try:
            header = pull_exchange(context, source.address, request, deadline, channels)
            return link.receiver.receive([header.frame_bytes] * header.num_layers, on_layer, deadline, transfer_id,
                                         checksummed=checksum)
        except BaseException as error:
            link.close()
            if isinstance(error, ChecksumMismatch):
                raise CorruptFrame(f"{link.receiver.backend} transfer: {error}") from error
            if isinstance(error, TransportError):
                raise PullFailed(f"{link.receiver.backend} transfer failed: {error}") from error
            raise
