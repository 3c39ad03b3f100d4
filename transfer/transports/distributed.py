"""torch.distributed links: a two-rank process group per worker pair, Gloo or NCCL.

One code path for both; the tensor device picks the process group (CPU -> Gloo,
CUDA -> NCCL), so everything here but ``_process_group`` runs on this machine through
Gloo. No global ``init_process_group``: each link builds its own group over its own
rendezvous store, so a worker can hold links to many peers, made as they are needed::

    sender (rank 0)                               receiver (rank 1)
    TCPStore(host, port 0, master) ── address ──▶ TCPStore(host, port)
    ProcessGroup(PrefixStore(name, store), 0, 2)  ProcessGroup(PrefixStore(name, store), 1, 2)

The address travels over the caller's control channel (see ``links``). Small
consecutive frames travel as one message (``transfer.transports.packing``), since each
send/receive pair has a fixed cost. The receiver posts the receive of message i+1
before storing message i's frames, so the wire and the scatter overlap. After a failure
the group is aborted and its buffers dropped: a receive that timed out might still
complete later, into memory that must then be nobody's. In a checksummed transfer each
message's digests travel as a small message of their own (tag DIGEST_TAG), received
alongside it.
"""

from __future__ import annotations

import os
import secrets
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from transfer.transports.base import HostedLink, LayerSink, Receiver, Sender
from transfer.transports.checksums import DIGEST_BYTES
from transfer.transports.errors import PeerLost, TransportError, TransportTimeout, seconds_left
from transfer.transports.header import HEADER_WORDS
from transfer.transports.packing import group_bytes, message_groups, store_group
from transfer.transports.settings import LinkOptions

SENDER_RANK, RECEIVER_RANK = 0, 1
HEADER_TAG, FRAME_TAG, DIGEST_TAG = 1, 2, 3


def process_group_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _timeout(deadline: float, what: str) -> timedelta:
    return timedelta(seconds=seconds_left(deadline, what))


def _process_group(store: dist.Store, name: str, rank: int, options: LinkOptions, deadline: float):
    """The pair's group; blocks until both ranks joined or the deadline passed."""
    prefixed = PrefixStore(f"kvroute-link/{name}", store)
    timeout = _timeout(deadline, "the peer to join the process group")
    if process_group_backend(options.device) == "nccl":
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, nccl_options)
    gloo_options = dist.ProcessGroupGloo._Options()
    gloo_options._timeout = timeout
    gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=options.settings.host)]
    return dist.ProcessGroupGloo(prefixed, rank, 2, gloo_options)


def _translate(backend: str, error: BaseException) -> TransportError | None:
    """Gloo and NCCL report everything as RuntimeError; its text says which failure it was."""
    if not isinstance(error, RuntimeError) or isinstance(error, TransportError):
        return None
    text = str(error)
    if "Timed out" in text or "timed out" in text:
        return TransportTimeout(f"{backend}: {text}")
    if "closed by peer" in text or "Connection reset" in text:
        return PeerLost(f"{backend}: {text}")
    return TransportError(f"{backend}: {text}")


class _WorkTracker:
    """torch.distributed Works (a message, and its digests) as the tracker ``SendBufferPool``
    expects; holds the digests' tensor until its send is done."""

    def __init__(self, *works: dist.Work, keep: torch.Tensor | None = None):
        self._works = works
        self._keep = keep

    @property
    def done(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def wait(self, timeout: float) -> None:
        # With a timeout, wait() blocks this thread (also for NCCL) and raises on failure.
        for work in self._works:
            work.wait(timedelta(seconds=max(timeout, 1e-3)))


class _GroupEnd:
    """What both ends hold: the group and the store that keeps its rendezvous alive."""

    def _attach(self, group, store: dist.Store) -> None:
        self._group = group
        self._store = store
        self.backend = process_group_backend(self.device)

    def _translate(self, error: BaseException) -> TransportError | None:
        return _translate(self.backend, error)

    def _close(self) -> None:
        self._group.abort()  # drops pending work without waiting for the peer
        self._group = self._store = None


class DistributedSender(_GroupEnd, Sender):
    def __init__(self, options: LinkOptions, group, store: dist.Store):
        Sender.__init__(self, options)
        self._attach(group, store)

    def _send_header(self, packed: bytes, deadline: float) -> _WorkTracker:
        header = torch.frombuffer(bytearray(packed), dtype=torch.int64).to(self.device)
        return _WorkTracker(self._group.send([header], RECEIVER_RANK, HEADER_TAG))

    def _message_groups(self, frame_bytes: tuple[int, ...]) -> list[range]:
        return message_groups(frame_bytes)

    def _send_buffer(self, buffer: torch.Tensor, deadline: float, digests: bytes | None) -> _WorkTracker:
        work = self._group.send([buffer], RECEIVER_RANK, FRAME_TAG)
        if digests is None:
            return _WorkTracker(work)
        digest_tensor = torch.frombuffer(bytearray(digests), dtype=torch.uint8).to(self.device)
        return _WorkTracker(work, self._group.send([digest_tensor], RECEIVER_RANK, DIGEST_TAG), keep=digest_tensor)


class DistributedReceiver(_GroupEnd, Receiver):
    def __init__(self, options: LinkOptions, group, store: dist.Store):
        Receiver.__init__(self, options)
        self._attach(group, store)
        self._ring: list[torch.Tensor] = []  # two receive buffers, reused across transfers

    def _wait(self, work: dist.Work, deadline: float) -> None:
        work.wait(_timeout(deadline, f"a frame from the {self.backend} sender"))

    def _receive_header(self, deadline: float) -> bytes:
        header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
        self._wait(self._group.recv([header], SENDER_RANK, HEADER_TAG), deadline)
        return header.cpu().numpy().tobytes()

    def _receive_frames(self, frame_bytes: tuple[int, ...], store: LayerSink, deadline: float,
                        checksummed: bool) -> None:
        groups = message_groups(frame_bytes)
        if not groups:
            return
        sizes = [group_bytes(frame_bytes, group) for group in groups]
        ring = self._ring_for(max(sizes))
        pending = self._post(ring[0], sizes[0], len(groups[0]) if checksummed else 0)
        for number, group in enumerate(groups):
            works, data, digests = pending
            for work in works:
                self._wait(work, deadline)
            if number + 1 < len(groups):  # the next message arrives while this one is stored
                next_digests = len(groups[number + 1]) if checksummed else 0
                pending = self._post(ring[(number + 1) % 2], sizes[number + 1], next_digests)
            store_group(frame_bytes, group, data, store,
                        None if digests is None else digests.cpu().numpy().tobytes())

    def _post(self, buffer: torch.Tensor, nbytes: int, num_digests: int):
        # Exactly the announced size: Gloo aborts the process on a longer message, and the
        # header check made sure the sender announced these sizes.
        data = buffer[:nbytes]
        works = [self._group.recv([data], SENDER_RANK, FRAME_TAG)]
        digests = None
        if num_digests:
            digests = torch.empty(num_digests * DIGEST_BYTES, dtype=torch.uint8, device=self.device)
            works.append(self._group.recv([digests], SENDER_RANK, DIGEST_TAG))
        return works, data, digests

    def _ring_for(self, nbytes: int) -> list[torch.Tensor]:
        if not self._ring or self._ring[0].numel() < nbytes:
            self._ring = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._ring

    def _close(self) -> None:
        super()._close()
        self._ring = []


def _listener(host: str) -> tuple[int, int]:
    """A listening socket on ``host`` alone, and its port, for the rendezvous store to own:
    a store that binds by itself listens on every interface, so anyone on any network the
    worker reaches could join the group while the link opens (docs/security.md). The store
    takes the descriptor over (libuv's store cannot, hence ``use_libuv=False``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen()
        port = listener.getsockname()[1]
        return listener.detach(), port
    except OSError:
        listener.close()
        raise


class DistributedBackend:
    def __init__(self, name: str):
        self.name = name  # "gloo" or "nccl": the same code, named by the device it serves

    def supports(self, device: torch.device) -> bool:
        if process_group_backend(device) != self.name:
            return False
        return dist.is_nccl_available() if self.name == "nccl" else dist.is_gloo_available()

    def host(self, options: LinkOptions, deadline: float) -> HostedLink:
        listener, port = _listener(options.settings.host)
        try:
            store = TCPStore(options.settings.host, port, 2, True, _timeout(deadline, "the rendezvous store"),
                             wait_for_workers=False, master_listen_fd=listener, use_libuv=False)
        except BaseException:
            os.close(listener)
            raise
        name = secrets.token_hex(8)
        address = f"{options.settings.host}:{store.port}/{name}"

        def accept(accept_deadline: float) -> DistributedSender:
            try:
                group = _process_group(store, name, SENDER_RANK, options, accept_deadline)
            except RuntimeError as error:
                raise _translate(self.name, error) from error
            return DistributedSender(options, group, store)

        return HostedLink(address, accept, cancel=lambda: None)

    def join(self, address: str, options: LinkOptions, deadline: float) -> DistributedReceiver:
        host_port, _, name = address.partition("/")
        host, _, port = host_port.rpartition(":")
        try:
            store = TCPStore(host, int(port), 2, False, _timeout(deadline, "the rendezvous store"))
            group = _process_group(store, name, RECEIVER_RANK, options, deadline)
        except RuntimeError as error:
            raise _translate(self.name, error) from error
        return DistributedReceiver(options, group, store)


GLOO = DistributedBackend("gloo")
NCCL = DistributedBackend("nccl")
