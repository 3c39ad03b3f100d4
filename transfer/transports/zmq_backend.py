"""ZeroMQ links over tcp or ipc: one PUSH socket on the sender, one PULL on the receiver.

Frames go out zero-copy from the link's send buffers (``transfer.send_buffers``: a
buffer is handed out again only once libzmq let go of it), small consecutive ones
packed into one message (``transfer.transports.packing``), and are read zero-copy on
the receiving side. In a checksummed transfer a message has two parts: its frames'
digests, then the frames (the last part is the payload, so the tracker pyzmq returns
is the payload's). ZeroMQ never reports a dead peer, so every wait polls against the
caller's deadline. A sender's completed send means the bytes left this process, not
that they arrived; only the receiver can confirm that.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from typing import TypeVar

import torch
import zmq

from foundation.zmq_auth import secure_client, secure_server
from transfer.block_client import frame_as_tensor
from transfer.send_buffers import send_frame
from transfer.transports.base import HostedLink, LayerSink, Receiver, Sender
from transfer.transports.checksums import DIGEST_BYTES
from transfer.transports.errors import FrameMismatch, TransportError, TransportTimeout, seconds_left
from transfer.transports.packing import group_bytes, message_groups, store_group
from transfer.transports.settings import LinkOptions

T = TypeVar("T")


def _wait_for(socket: zmq.Socket, event: int, deadline: float, what: str) -> None:
    if not socket.poll(int(seconds_left(deadline, what) * 1000) + 1, event):
        raise TransportTimeout(f"deadline passed waiting for {what}")


def send_by_deadline(socket: zmq.Socket, send: Callable[[int], T], deadline: float, what: str) -> T:
    """``send(flags)`` once the socket takes it, never blocking past ``deadline``. A PUSH
    socket can poll writable and lose its only peer before the send: a blocking send would
    then wait for a new peer forever, so the send never blocks and a refusal polls again.
    The send is tried first: a poll per message costs more than the send itself, and a
    socket that is streaming usually has room."""
    while True:
        try:
            return send(zmq.NOBLOCK)
        except zmq.Again:
            _wait_for(socket, zmq.POLLOUT, deadline, what)


class ZmqSender(Sender):
    def __init__(self, options: LinkOptions, socket: zmq.Socket, name: str, ipc_path: str | None):
        super().__init__(options)
        self.backend = name
        self._socket = socket
        self._ipc_path = ipc_path

    def _send_header(self, packed: bytes, deadline: float) -> None:
        # PUSH is not writable before a receiver connected, so a peer that never joined times out.
        send_by_deadline(self._socket, lambda flags: self._socket.send(packed, flags), deadline,
                         "the receiver to accept frames")

    def _message_groups(self, frame_bytes: tuple[int, ...]) -> list[range]:
        return message_groups(frame_bytes)

    # One PUSH socket with one peer: libzmq writes its messages in order and lets go of each
    # when written, so a transfer's last message finishing means all of them did.
    completes_in_order = True

    def _send_buffer(self, buffer: torch.Tensor, deadline: float, digests: bytes | None) -> zmq.MessageTracker:
        # Zero-copy and tracked whatever its size: its tracker frees the whole transfer's buffers.
        # libzmq takes the remaining parts of a message once it took the first, so a NOBLOCK
        # refusal can only come before anything of it was queued.
        parts = [memoryview(buffer.numpy())] if digests is None else [digests, memoryview(buffer.numpy())]
        return send_by_deadline(self._socket,
                                lambda flags: self._socket.send_multipart(parts, flags, copy=False, track=True),
                                deadline, "the receiver to accept frames")

    def _send_untracked(self, buffer: torch.Tensor, deadline: float, digests: bytes | None) -> None:
        prefix = [] if digests is None else [digests]
        send_by_deadline(self._socket, lambda flags: send_frame(self._socket, prefix, buffer, flags, track=False),
                         deadline, "the receiver to accept frames")

    def _translate(self, error: BaseException) -> TransportError | None:
        if isinstance(error, zmq.NotDone):
            return TransportTimeout(f"{self.backend}: a zero-copy send did not complete before the deadline")
        if isinstance(error, zmq.ZMQError):
            return TransportError(f"{self.backend}: {error}")
        return None

    def _close(self) -> None:
        self._socket.close(linger=0)
        _remove_socket_file(self._ipc_path)


class ZmqReceiver(Receiver):
    def __init__(self, options: LinkOptions, socket: zmq.Socket, name: str):
        super().__init__(options)
        self.backend = name
        self._socket = socket

    def _receive_message(self, deadline: float) -> list[zmq.Frame]:
        # Tried before polling: while a transfer streams in, the next message has usually arrived.
        try:
            return self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            _wait_for(self._socket, zmq.POLLIN, deadline, f"a frame from the {self.backend} sender")
            return self._socket.recv_multipart(copy=False)

    def _receive_header(self, deadline: float) -> bytes:
        parts = self._receive_message(deadline)
        if len(parts) != 1:
            raise FrameMismatch(f"expected a one-part transfer header, got {len(parts)} parts")
        return parts[0].bytes

    def _receive_frames(self, frame_bytes: tuple[int, ...], store: LayerSink, deadline: float,
                        checksummed: bool) -> None:
        for group in message_groups(frame_bytes):
            nbytes = group_bytes(frame_bytes, group)
            expected = [DIGEST_BYTES * len(group), nbytes] if checksummed else [nbytes]
            parts = self._receive_message(deadline)
            if [len(part) for part in parts] != expected:
                raise FrameMismatch(f"frames {group.start}-{group.stop - 1}: got parts of "
                                    f"{[len(part) for part in parts]} bytes, expected {expected}")
            # torch.frombuffer refuses an empty buffer; a message of empty frames is legal.
            data = frame_as_tensor(parts[-1]) if nbytes else torch.empty(0, dtype=torch.uint8)
            store_group(frame_bytes, group, data, store, parts[0].bytes if checksummed else None)

    def _translate(self, error: BaseException) -> TransportError | None:
        return TransportError(f"{self.backend}: {error}") if isinstance(error, zmq.ZMQError) else None

    def _close(self) -> None:
        self._socket.close(linger=0)


def _remove_socket_file(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def remove_ipc_socket_file(endpoint: str) -> None:
    """libzmq leaves a bound ipc socket's file behind: remove it (nothing to do for tcp)."""
    if endpoint.startswith("ipc://"):
        _remove_socket_file(endpoint.removeprefix("ipc://"))


class ZmqBackend:
    def __init__(self, transport: str):
        assert transport in ("tcp", "ipc")
        self.transport = transport
        self.name = f"zmq-{transport}"

    def supports(self, device: torch.device) -> bool:
        return device.type == "cpu"  # libzmq reads and writes host memory only

    def _bind_address(self, options: LinkOptions) -> tuple[str, str | None]:
        if self.transport == "tcp":
            return f"tcp://{options.settings.host}:*", None
        path = os.path.join(options.settings.ipc_directory, f"kvroute-link-{secrets.token_hex(8)}.sock")
        return f"ipc://{path}", path

    def host(self, options: LinkOptions, deadline: float) -> HostedLink:
        bind_address, ipc_path = self._bind_address(options)
        socket = secure_server(options.context().socket(zmq.PUSH), "worker", transfer=True)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(bind_address)
        address = socket.getsockopt_string(zmq.LAST_ENDPOINT)

        def cancel() -> None:
            socket.close(linger=0)
            _remove_socket_file(ipc_path)

        return HostedLink(address, lambda _deadline: ZmqSender(options, socket, self.name, ipc_path), cancel)

    def join(self, address: str, options: LinkOptions, deadline: float) -> ZmqReceiver:
        socket = secure_client(options.context().socket(zmq.PULL), "worker", transfer=True)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        return ZmqReceiver(options, socket, self.name)


TCP = ZmqBackend("tcp")
IPC = ZmqBackend("ipc")
