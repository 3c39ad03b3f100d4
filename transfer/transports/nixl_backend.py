"""NIXL links: the receiver READs each message of frames from the sender's registered memory.

::

    sender (agent S)                                  receiver (agent R)
    host: LinkSetup address = link id + S's metadata ──▶ join: load S
          ◀── notice Joined(R's metadata) ──────────
    load R ── notice Accepted ─────────────────────▶
    send: ── Header ───────────────────────────────▶ check it
          fill message i into a registered buffer
          ── Frames(i, address, size, digests) ────▶ READ it into a registered buffer
          ◀── Released(i) ─────────────────────────  (the sender's buffer is free again)
                                                     check digests, store the frames

Metadata travels only over kvroute's channels: the sender's in the LinkSetup address
(~450 characters), the receiver's back in a NIXL notification over the connection that
metadata made. Buffers are registered once, when the pool makes them, and reused; the
partial metadata of a new buffer rides on the first Frames notice that uses it.

Why READ rather than the sender WRITEing into the receiver's memory: both ran at the same
speed here (16 MiB: 6.0-6.2 GB/s READ, 5.3-6.2 GB/s WRITE over UCX's cma), so the choice
is about ownership. The receiver's memory is never open to a peer's writes, the receiver
checks the header and each message's size before a byte lands in its memory, and only the
sender needs to tell its peer about new registrations. It is also the direction of
issue 35's next step, decode workers READing staged leases straight into their caches.
A message is consecutive frames of up to ``MESSAGE_BYTES`` (``packing``): the sender fills
message i+1 while the receiver reads message i. Each message costs two notifications and a
polled READ, so messages are larger than on the ZeroMQ links: transfers of 8-50 MB in 30
frames ran at 0.54-0.89 times raw pyzmq ipc's speed in messages of 1 MiB, and at 1.1-1.4
times in messages of 16 MiB (loopback, ``kvroute.bench.transfer_pair``).

Phase 1 limits: a frame lent as it lies (``frame_view``) is copied into a registered
buffer instead of filled, since it is not registered itself; CUDA frames register VRAM and READ it with the
same calls, but have never run (no GPU here).

UCX transport: left to UCX. On one host it picks cma (process_vm_readv, zero-copy) for the
READs and tcp for the notifications. Do not narrow UCX_TLS to tcp (READs are then emulated
in software: 0.35 times raw pyzmq ipc's speed against 1.4) or to shm (refused: NIXL needs a
peer-failure handler, which the shared-memory transports lack). UCX's tcp listener stays on
``lo`` for links on a loopback address, and its tcp segments are 1 MiB, for the READs it
emulates between hosts (``nixl_agent.ucx_environment``).

Failures: every wait polls against the caller's deadline. A closing end tells its peer
(Closed), so the peer fails at once rather than at its deadline. Memory a peer might still
be READing, or a READ might still be writing, is held a while before it is freed
(``nixl_buffers``).
"""

from __future__ import annotations

import base64
import binascii
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from transfer.transports.base import FrameView, HostedLink, LayerSink, LayerSource, Receiver, Sender
from transfer.transports.checksums import DIGEST_BYTES
from transfer.transports.errors import FrameMismatch, LinkRefused, PeerLost, TransportError
from transfer.transports.handshake import RECEIVER, SENDER
from transfer.transports.nixl_agent import (
    Accepted,
    Agent,
    Closed,
    Frames,
    Header,
    Joined,
    Notice,
    Released,
    agent_for,
    device_index,
    nixl_missing,
    wait_until,
)
from transfer.transports.nixl_buffers import ReadBuffer, RegisteredBuffers
from transfer.transports.packing import group_bytes, message_groups, store_group
from transfer.transports.settings import LinkOptions

NAME = "nixl"
ADDRESS_PREFIX = "nixl://"
MESSAGE_BYTES = 16 << 20
def format_address(link: str, metadata: bytes) -> str:
    return f"{ADDRESS_PREFIX}{link}/{base64.urlsafe_b64encode(metadata).decode()}"


def parse_address(address: str) -> tuple[str, bytes]:
    """(link id, the sender agent's metadata); LinkRefused for anything else."""
    link, _, encoded = address.removeprefix(ADDRESS_PREFIX).partition("/")
    try:
        if not address.startswith(ADDRESS_PREFIX) or not link or not encoded:
            raise ValueError("missing parts")
        return link, base64.urlsafe_b64decode(encoded.encode())
    except (ValueError, binascii.Error) as error:
        raise LinkRefused(f"not a nixl link address ({error}): {address[:80]!r}") from None


def translate(error: BaseException) -> TransportError | None:
    """NIXL's own exceptions (nixl_cu12._bindings.nixl*Error) as TransportErrors."""
    kind = type(error).__name__
    if not type(error).__module__.startswith("nixl_cu12"):
        return None
    if kind == "nixlRemoteDisconnectError":
        return PeerLost(f"nixl: the peer disconnected ({error})")
    return TransportError(f"nixl: {kind}: {error}")


@contextmanager
def nixl_errors() -> Iterator[None]:
    """Raise NIXL's exceptions as TransportErrors (outside a transfer, which ``_translate`` covers)."""
    try:
        yield
    except Exception as error:
        translated = translate(error)
        if translated is None:
            raise
        raise translated from error


class _NixlEnd:
    """What both ends hold: the agent, the link id, the peer agent's name."""

    def _attach(self, agent: Agent, link: str, peer: str) -> None:
        self._agent, self._link, self._peer = agent, link, peer

    def _next(self, deadline: float, what: str) -> Notice:
        return wait_until(self._poll, deadline, what)

    def _poll(self) -> Notice | None:
        found = self._agent.poll(self._link)
        if found is None:
            return None
        sender, notice = found
        if sender != self._peer:
            raise FrameMismatch(f"a notice for this link came from {sender}, not from its peer {self._peer}")
        if isinstance(notice, Closed):
            raise PeerLost(f"the nixl peer closed the link: {notice.reason}")
        return notice

    def _translate(self, error: BaseException) -> TransportError | None:
        return translate(error)

    def _leave(self, reason: str) -> None:
        try:
            self._agent.notify(self._peer, Closed(self._link, reason))
        except Exception:  # noqa: BLE001 - the peer may be gone; it then times out
            pass
        self._agent.mailboxes.close(self._link)
        try:
            self._agent.drop_peer(self._peer)
        except Exception:  # noqa: BLE001 - NIXL may refuse while a READ of it is stuck
            pass


class _Release:
    """A message's send tracker: done once the receiver released it (read it)."""

    def __init__(self, sender: NixlSender, message: int):
        self._sender, self._message = sender, message

    @property
    def done(self) -> bool:
        return self._sender.released(self._message)

    def wait(self, timeout: float) -> None:
        wait_until(lambda: self.done or None, time.monotonic() + timeout,
                   f"the nixl receiver to read message {self._message}")


class NixlSender(_NixlEnd, Sender):
    backend = NAME

    def __init__(self, options: LinkOptions, agent: Agent, link: str, peer: str):
        self._attach(agent, link, peer)
        Sender.__init__(self, options)
        self._next_message = 0
        self._released_through = -1  # the receiver reads, so releases, messages in order

    def _new_buffer_pool(self) -> RegisteredBuffers:
        return RegisteredBuffers(self._agent, self.device)

    def _message_groups(self, frame_bytes: tuple[int, ...]) -> list[range]:
        return message_groups(frame_bytes, MESSAGE_BYTES)

    def _message(self, frame_bytes: tuple[int, ...], group: range, fill: LayerSource,
                 frame_view: FrameView | None) -> tuple[int | None, torch.Tensor]:
        """Every message is staged in a registered buffer; a frame with a view is copied from
        it rather than filled (the view's memory is not registered, so the peer cannot READ it)."""
        if frame_view is None:
            return super()._message(frame_bytes, group, fill, None)

        def copy_or_fill(index: int, out: torch.Tensor) -> None:
            view = frame_view(index)
            if view is None:
                fill(index, out)
            else:
                out.copy_(view.view(torch.uint8).reshape(-1))

        return super()._message(frame_bytes, group, copy_or_fill, None)

    def _send_header(self, packed: bytes, deadline: float) -> None:
        self._agent.notify(self._peer, Header(self._link, packed))

    def _send_buffer(self, buffer: torch.Tensor, deadline: float, digests: bytes | None) -> _Release:
        message, self._next_message = self._next_message, self._next_message + 1
        self._agent.notify(self._peer, Frames(self._link, message, buffer.data_ptr(), buffer.numel(),
                                              device_index(buffer), digests, self._buffers.take_new_metadata()))
        return _Release(self, message)

    def released(self, message: int) -> bool:
        while message > self._released_through and (notice := self._poll()) is not None:
            if not isinstance(notice, Released) or notice.message != self._released_through + 1:
                raise FrameMismatch(f"expected the release of message {self._released_through + 1}, got {notice}")
            self._released_through = notice.message
        return message <= self._released_through

    def _close(self) -> None:
        self._leave("the sender closed the link")
        self._buffers.close()


class NixlReceiver(_NixlEnd, Receiver):
    backend = NAME

    def __init__(self, options: LinkOptions, agent: Agent, link: str, peer: str):
        Receiver.__init__(self, options)
        self._attach(agent, link, peer)
        self._next_message = 0
        self._buffer = ReadBuffer(agent, self.device)
        self._reading = None  # a READ's handle while it may still write into the buffer

    @property
    def peer(self) -> str:
        return self._peer

    def wait_accepted(self, deadline: float) -> None:
        self._expect(Accepted, deadline, "the nixl sender to accept the link")

    def _expect(self, kind: type, deadline: float, what: str):
        notice = self._next(deadline, what)
        if not isinstance(notice, kind):
            raise FrameMismatch(f"expected {what} on the nixl link, got {type(notice).__name__}")
        return notice

    def _receive_header(self, deadline: float) -> bytes:
        return self._expect(Header, deadline, "a transfer header").packed

    def _receive_frames(self, frame_bytes: tuple[int, ...], store: LayerSink, deadline: float,
                        checksummed: bool) -> None:
        for group in message_groups(frame_bytes, MESSAGE_BYTES):
            frames = self._expect(Frames, deadline, f"frames {group.start}-{group.stop - 1}")
            self._check(frames, group_bytes(frame_bytes, group), DIGEST_BYTES * len(group) if checksummed else 0)
            for metadata in frames.metadata:
                self._agent.learn(metadata)
            data = self._read(frames, deadline)
            self._agent.notify(self._peer, Released(self._link, frames.message))
            store_group(frame_bytes, group, data, store, frames.digests)

    def _check(self, frames: Frames, nbytes: int, digest_bytes: int) -> None:
        got_digests = len(frames.digests) if frames.digests is not None else 0
        if (frames.message, frames.nbytes, got_digests) != (self._next_message, nbytes, digest_bytes):
            raise FrameMismatch(f"message {frames.message} of {frames.nbytes} bytes with {got_digests} digest "
                                f"bytes, expected message {self._next_message} of {nbytes} with {digest_bytes}")
        self._next_message += 1

    def _read(self, frames: Frames, deadline: float) -> torch.Tensor:
        into = self._buffer.take(frames.nbytes)
        if frames.nbytes == 0:
            return into
        self._reading = self._agent.read(into, self._peer, frames.address, frames.device)
        state = wait_until(self._read_state, deadline, f"a READ of {frames.nbytes} bytes from the nixl sender")
        handle, self._reading = self._reading, None
        handle.release()
        if state != "DONE":
            raise PeerLost(f"nixl: a READ of {frames.nbytes} bytes from the sender failed")
        return into

    def _read_state(self) -> str | None:
        """The READ's final state ("DONE" or "ERR"), None while it runs."""
        state = self._agent.state(self._reading)
        return None if state == "PROC" else state

    def _close(self) -> None:
        if self._reading is not None:  # a READ that timed out may still write into the buffer
            try:
                self._reading.release()
            except Exception:  # noqa: BLE001 - NIXL could not cancel it: keep its memory alive
                self._buffer.quarantine(self._reading)
        self._leave("the receiver closed the link")
        self._buffer.close()


class NixlBackend:
    name = NAME

    def supports(self, device: torch.device) -> bool:
        return device.type in ("cpu", "cuda") and not nixl_missing()

    def unavailable(self) -> str:
        """Why this process cannot run nixl links ("" when it can)."""
        return nixl_missing()

    def host(self, options: LinkOptions, deadline: float) -> HostedLink:
        agent = _agent(SENDER, options)
        link = secrets.token_hex(16)
        agent.mailboxes.open(link)

        def accept(accept_by: float) -> NixlSender:
            try:
                with nixl_errors():
                    return NixlSender(options, agent, link, _accept(agent, link, accept_by))
            except BaseException:
                agent.mailboxes.close(link)
                raise

        with nixl_errors():
            address = format_address(link, agent.connection_metadata())
        return HostedLink(address, accept, cancel=lambda: agent.mailboxes.close(link))

    def join(self, address: str, options: LinkOptions, deadline: float) -> NixlReceiver:
        link, metadata = parse_address(address)
        agent = _agent(RECEIVER, options)
        agent.mailboxes.open(link)
        try:
            with nixl_errors():
                receiver = NixlReceiver(options, agent, link, agent.add_peer(metadata))
        except BaseException:
            agent.mailboxes.close(link)
            raise
        try:
            with nixl_errors():
                agent.notify(receiver.peer, Joined(link, agent.connection_metadata()))
                receiver.wait_accepted(deadline)
        except BaseException:
            receiver.close()
            raise
        return receiver


def _agent(role: str, options: LinkOptions) -> Agent:
    missing = nixl_missing()
    if missing:
        raise LinkRefused(f"nixl links cannot run here: {missing}")
    try:
        return agent_for(role, options.settings.host)
    except Exception as error:
        raise LinkRefused(f"no NIXL agent with the UCX backend could start: {error}") from error


def _accept(agent: Agent, link: str, deadline: float) -> str:
    """Wait for the receiver's Joined, load its metadata and answer; returns its agent's name."""
    sender, notice = wait_until(lambda: agent.poll(link), deadline, "the nixl receiver to join")
    if not isinstance(notice, Joined):
        raise FrameMismatch(f"expected the receiver to join the nixl link, got {type(notice).__name__}")
    peer = agent.add_peer(notice.metadata)
    try:
        if peer != sender:
            raise LinkRefused(f"the nixl receiver {sender} sent the metadata of {peer}")
        agent.notify(peer, Accepted(link))
    except BaseException:
        agent.drop_peer(peer)
        raise
    return peer


NIXL = NixlBackend()
