"""An in-process backend for tests: the two ends share a bounded mailbox.

It goes through the same first contact, header and size checks as the real backends;
only the wire is a ``queue.Queue`` of copied frames. A copy is what a real wire does,
so the sender's buffer is free as soon as it is queued. The bounded queue makes a
receiver that stopped reading look like a dead peer: the sender times out.
"""

from __future__ import annotations

import queue
import secrets
import threading

import torch

from transfer.transports.base import HostedLink, LayerSink, Receiver, Sender
from transfer.transports.errors import FrameMismatch, LinkRefused, PeerLost, TransportTimeout, seconds_left
from transfer.transports.packing import store_group
from transfer.transports.settings import LinkOptions

NAME = "fake"
MAILBOX_FRAMES = 8
_CLOSED = object()  # put by a closing sender, so a waiting receiver fails at once

_mailboxes: dict[str, queue.Queue] = {}
_mailboxes_lock = threading.Lock()


class FakeSender(Sender):
    backend = NAME

    def __init__(self, options: LinkOptions, address: str, mailbox: queue.Queue):
        super().__init__(options)
        self._address = address
        self._mailbox = mailbox

    def _put(self, item, deadline: float) -> None:
        try:
            self._mailbox.put(item, timeout=seconds_left(deadline, "room in the fake link"))
        except queue.Full:
            raise TransportTimeout("the fake link's receiver stopped reading") from None

    def _send_header(self, packed: bytes, deadline: float) -> None:
        self._put(packed, deadline)

    def _send_buffer(self, buffer: torch.Tensor, deadline: float, digests: bytes | None) -> None:
        self._put((buffer.clone(), digests), deadline)

    def _close(self) -> None:
        with _mailboxes_lock:
            _mailboxes.pop(self._address, None)
        try:
            self._mailbox.put_nowait(_CLOSED)
        except queue.Full:  # the receiver is not reading; it times out instead
            pass


class FakeReceiver(Receiver):
    backend = NAME

    def __init__(self, options: LinkOptions, mailbox: queue.Queue):
        super().__init__(options)
        self._mailbox = mailbox

    def _get(self, deadline: float):
        try:
            item = self._mailbox.get(timeout=seconds_left(deadline, "a frame on the fake link"))
        except queue.Empty:
            raise TransportTimeout("no frame from the fake link's sender before the deadline") from None
        if item is _CLOSED:
            raise PeerLost("the fake link's sender closed it")
        return item

    def _receive_header(self, deadline: float) -> bytes:
        header = self._get(deadline)
        if not isinstance(header, bytes):
            raise FrameMismatch("expected a transfer header on the fake link, got a frame")
        return header

    def _receive_frames(self, frame_bytes: tuple[int, ...], store: LayerSink, deadline: float,
                        checksummed: bool) -> None:
        for index, nbytes in enumerate(frame_bytes):
            item = self._get(deadline)
            if not isinstance(item, tuple):
                raise FrameMismatch(f"frame {index}: expected a frame on the fake link, got a header")
            frame, digests = item
            if frame.numel() != nbytes or (digests is not None) != checksummed:
                raise FrameMismatch(f"frame {index}: got {frame.numel()} bytes (digest: {digests is not None}), "
                                    f"expected {nbytes} (digest: {checksummed})")
            store_group(frame_bytes, range(index, index + 1), frame, store, digests)

    def _close(self) -> None:
        pass


class FakeBackend:
    def supports(self, device: torch.device) -> bool:
        return True

    def host(self, options: LinkOptions, deadline: float) -> HostedLink:
        address = f"fake://{secrets.token_hex(8)}"
        mailbox: queue.Queue = queue.Queue(maxsize=MAILBOX_FRAMES)
        with _mailboxes_lock:
            _mailboxes[address] = mailbox

        def cancel() -> None:
            with _mailboxes_lock:
                _mailboxes.pop(address, None)

        return HostedLink(address, lambda _deadline: FakeSender(options, address, mailbox), cancel)

    def join(self, address: str, options: LinkOptions, deadline: float) -> FakeReceiver:
        with _mailboxes_lock:
            mailbox = _mailboxes.get(address)
        if mailbox is None:
            raise LinkRefused(f"no fake link at {address}: fake links only work within one process")
        return FakeReceiver(options, mailbox)


BACKEND = FakeBackend()
