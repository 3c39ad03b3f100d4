"""The transport interface: a one-way link that moves a list of contiguous byte frames.

A transfer is what the KV wire format produces, one frame per layer (see
``transfer.kv_layout``), preceded by a header (``transfer.transports.header``)::

    sender.send(frame_bytes, fill, deadline, transfer_id, checksummed=…)
        header ──▶ frame 0 ──▶ frame 1 ──▶ … ──▶ frame n-1
    receiver.receive(frame_bytes, store, deadline, transfer_id, checksummed=…)

The sender never hands a caller's tensor to the wire: ``fill(index, out)`` writes
frame ``index`` into a link-owned buffer (a gather from the KV cache, typically), which
is reused only after its send completed (``transfer.send_buffers``). The receiver calls
``store(index, data)`` once per frame, in order; ``data`` is valid during the call only
(a scatter into the KV cache, typically). Both ends know the frame sizes beforehand,
since the receiver asked for those blocks; the header makes them agree or fail. In a
checksummed transfer each message carries the digests of its frames
(``transfer.transports.checksums``), and the receiver checks a frame before ``store``
sees it.

Ownership: a lock serialises the calls on one end, so two transfers never interleave
their frames; which transfer goes first is the caller's protocol, and the transfer id
turns a disagreement into an error instead of mixed-up blocks. Any failure, including
an exception from ``fill`` or ``store``, closes the end: frames of that transfer may
still be in flight, so nothing on the link can be trusted afterwards. Open a new link.

Backends implement the underscore hooks; the template here is the one code path.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from transfer.send_buffers import SendBufferPool, Tracker
from transfer.transports.checksums import frame_digest
from transfer.transports.errors import LinkClosed, TransportError, seconds_left
from transfer.transports.header import TransferHeader
from transfer.transports.settings import LinkOptions

LayerSource = Callable[[int, torch.Tensor], None]
# Frame ``index`` as it lies in the caller's memory, to send as is (None: fill it instead).
FrameView = Callable[[int], "torch.Tensor | None"]
LayerSink = Callable[[int, torch.Tensor], None]


class _LinkEnd(ABC):
    backend: str  # the backend's name, e.g. "zmq-tcp"
    # How "auto" chose this backend when it measured the candidates (``probing``): a
    # foundation.wire.LinkMeasurement, set on both ends; None when nothing was measured.
    measurement = None

    def __init__(self, options: LinkOptions):
        self.options = options
        self.device = options.device
        self.closed = False
        self._lock = threading.Lock()

    def close(self) -> None:
        """Idempotent; waits for a transfer in progress, which its deadline bounds."""
        with self._lock:
            self._close_once()

    def _close_once(self) -> None:
        if not self.closed:
            self.closed = True
            self._close()

    def _run(self, transfer: Callable[[], None]) -> None:
        """Run one transfer under the lock; any failure closes this end."""
        with self._lock:
            if self.closed:
                raise LinkClosed(f"{self.backend} link is closed")
            try:
                transfer()
            except BaseException as error:
                self._close_once()
                translated = self._translate(error)
                if translated is None:
                    raise
                raise translated from error

    def _translate(self, error: BaseException) -> TransportError | None:
        """A backend's own exception as a TransportError; None keeps it as it is."""
        return None

    @abstractmethod
    def _close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Sender(_LinkEnd):
    def __init__(self, options: LinkOptions):
        super().__init__(options)
        self._buffers = self._new_buffer_pool()

    def _new_buffer_pool(self) -> SendBufferPool:
        """Where messages are filled; a backend whose peer reads them in place registers them."""
        return SendBufferPool(device=self.device)

    def send(self, frame_bytes: Sequence[int], fill: LayerSource, deadline: float,
             transfer_id: int = 0, frame_view: FrameView | None = None, checksummed: bool = False) -> int:
        """Send one transfer; returns its payload bytes once every frame has left this end.

        ``frame_view``: for memory that stays unchanged until then (a staged lease), a frame
        that travels alone goes out as it lies when ``frame_view(index)`` gives its bytes
        (contiguous uint8 on this end's device), with no copy into a send buffer."""
        header = TransferHeader(transfer_id, tuple(frame_bytes), checksummed)
        self._run(lambda: self._send_transfer(header, fill, frame_view, deadline))
        return header.total_bytes

    def _send_transfer(self, header: TransferHeader, fill: LayerSource, frame_view: FrameView | None,
                       deadline: float) -> None:
        trackers = [self._send_header(header.pack(), deadline)]
        groups = self._message_groups(header.frame_bytes)
        untracked_slots = []
        for position, group in enumerate(groups):
            slot, message = self._message(header.frame_bytes, group, fill, frame_view)
            digests = _digests(header.frame_bytes, group, message) if header.checksummed else None
            if self.completes_in_order and position < len(groups) - 1:
                self._send_untracked(message, deadline, digests)
                if slot is not None:
                    untracked_slots.append(slot)
                continue
            tracker = self._send_buffer(message, deadline, digests)
            if slot is not None:
                self._buffers.mark_sent(slot, tracker)
            trackers.append(tracker)
        for slot in untracked_slots:  # in flight until the last message is done
            self._buffers.mark_sent(slot, trackers[-1])
        # Newest first: messages on a link leave in order, so once the last is done the others
        # are too, and this thread wakes once per transfer instead of once per message (each
        # wake-up takes a core from the I/O thread still sending, on a machine with few).
        for tracker in reversed(trackers):
            if tracker is not None and not tracker.done:
                tracker.wait(seconds_left(deadline, f"a {self.backend} send to complete"))

    def _message(self, frame_bytes: tuple[int, ...], group: range, fill: LayerSource,
                 frame_view: FrameView | None) -> tuple[int | None, torch.Tensor]:
        """One message's bytes and the send-buffer slot holding them (None: the caller's own)."""
        if frame_view is not None and len(group) == 1:
            view = frame_view(group.start)
            if view is not None and self._sendable_as_is(view, frame_bytes[group.start]):
                return None, view
        sizes = [frame_bytes[index] for index in group]
        slot, buffer = self._buffers.acquire(sum(sizes))
        offset = 0
        for index, nbytes in zip(group, sizes):
            fill(index, buffer[offset:offset + nbytes])
            offset += nbytes
        return slot, buffer

    def _sendable_as_is(self, view: torch.Tensor, nbytes: int) -> bool:
        if view.numel() != nbytes or view.dtype != torch.uint8:
            raise ValueError(f"a frame view of {view.numel()} {view.dtype} elements for a frame of {nbytes} bytes")
        # Elsewhere (host memory for a CUDA link) or strided, it is copied into a buffer instead.
        return view.device == self.device and view.is_contiguous()

    # Whether this backend's messages complete in the order they were sent (one socket, one
    # peer, one queue): then only the last message of a transfer is tracked, its completion
    # stands for all, and ``_send_buffer`` must return a tracker for it.
    completes_in_order = False

    def _send_untracked(self, buffer: torch.Tensor, deadline: float, digests: bytes | None) -> None:
        """Start sending a message that is not the last of a transfer (``completes_in_order``)."""
        raise NotImplementedError

    def _message_groups(self, frame_bytes: tuple[int, ...]) -> list[range]:
        """Which consecutive frames travel together as one message; by default each alone."""
        return [range(index, index + 1) for index in range(len(frame_bytes))]

    @abstractmethod
    def _send_header(self, packed: bytes, deadline: float) -> Tracker | None: ...

    @abstractmethod
    def _send_buffer(self, buffer: torch.Tensor, deadline: float, digests: bytes | None) -> Tracker | None:
        """Start sending one message (a group of frames) with its frames' ``digests`` (None:
        an unchecked transfer); None when ``buffer`` may be reused at once."""


class Receiver(_LinkEnd):
    def receive(self, frame_bytes: Sequence[int], store: LayerSink, deadline: float,
                transfer_id: int = 0, checksummed: bool = False) -> int:
        """Receive one transfer into ``store``; returns its payload bytes. ``checksummed``:
        every frame must match its digest before it is stored (ChecksumMismatch otherwise)."""
        expected = TransferHeader(transfer_id, tuple(frame_bytes), checksummed)
        self._run(lambda: self._receive_transfer(expected, store, deadline))
        return expected.total_bytes

    def _receive_transfer(self, expected: TransferHeader, store: LayerSink, deadline: float) -> None:
        expected.check(self._receive_header(deadline))
        self._receive_frames(expected.frame_bytes, store, deadline, expected.checksummed)

    @abstractmethod
    def _receive_header(self, deadline: float) -> bytes: ...

    @abstractmethod
    def _receive_frames(self, frame_bytes: tuple[int, ...], store: LayerSink, deadline: float,
                        checksummed: bool) -> None:
        """Call ``store(index, data)`` for each frame, checking each frame's size and, when
        ``checksummed``, its digest (``packing.store_group`` does both)."""


def _digests(frame_bytes: tuple[int, ...], group: range, message: torch.Tensor) -> bytes:
    """The digests of one message's frames, in order."""
    digests, offset = [], 0
    for index in group:
        digests.append(frame_digest(message[offset:offset + frame_bytes[index]]))
        offset += frame_bytes[index]
    return b"".join(digests)


@dataclass
class HostedLink:
    """The hosting (sending) end between announcing ``address`` and the peer joining."""

    address: str
    accept: Callable[[float], Sender]  # accept(deadline): the sender, once the peer joined
    cancel: Callable[[], None]  # release what was bound, when the link is not opened after all


class Backend(Protocol):
    """One way of moving frames. The sender hosts (binds, or runs the rendezvous store);
    the receiver joins at the address the sender announced over the control channel."""

    def supports(self, device: torch.device) -> bool: ...

    def host(self, options: LinkOptions, deadline: float) -> HostedLink: ...

    def join(self, address: str, options: LinkOptions, deadline: float) -> Receiver: ...
