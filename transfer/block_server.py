"""The transfer endpoint of one engine: serves leased blocks, releases, and counters.

Runs as a daemon thread inside vLLM's model-worker process, next to the KV cache it
reads; a staged lease (see ``transfer.leases``) is served from its own host copy.
Protocol over one ROUTER socket (client: a DEALER)::

    PullBlocks ──▶ PullHeader(ok) ──▶ one raw frame per layer (blocks in request order);
        with ``checksum``, each frame comes after its xxh3 digest (transfer.transports.checksums)
    PullBlocks from this host, staged lease ──▶ PullHeader(ok, shared_copy): the consumer
        reads the lease's copy itself (transfer.shared_copies); no frames follow. A lease in
        the staging arena is offered so only to a consumer that confirms (confirms_shared):
        its ref carries a pin, and ConfirmRead ──▶ ConfirmReadReply follows the read
    PullBlocks(direct), lease in the staging arena ──▶ PullHeader(ok, direct): the consumer
        READs the copy with NIXL (transfer.direct_exports), then ConfirmRead ──▶ ConfirmReadReply
    OpenLink ──▶ LinkHello, LinkSetup (a transport link to that consumer; see link_control)
    PullOverLink ──▶ PullHeader(ok), the layers as one transfer over the consumer's link
    ReleaseLease ──▶ ReleaseReply
    TransferStatsRequest ──▶ TransferStatsReply
    PullRecordsRequest ──▶ PullRecordsReply (this engine's recent pulls for a request)
    anything else ──▶ ErrorReply, and the server stays up

A pull may arrive before the engine has granted its lease (a grant reaches this process
at the start of the engine's next step after the request finished), so unknown handles
are parked briefly before being refused; a handle whose lease expired is refused at once.
At most ``max_parked`` pulls wait at a time: beyond that a pull for an unknown handle is
refused at once, so pulls naming handles that never come cost bounded memory and time.

Links are opened on this thread, which serves every pull, so it hosts only the backends
it was configured for (``TransportSettings.hosted``): a consumer asking for another
(Gloo, say, whose hosting waits for the peer to join) is refused at first contact.
Refusals caused by what a peer sent are logged at most once per interval per peer.

The server thread is also the one place leases expire. An idle engine does not step
(and a staged lease lets it go idle at once), so expiry cannot wait for the engine. And
since releases arrive here too, every lease ends on this thread, never while it is
sending that lease's blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import zmq

from foundation import wire
from foundation.log_limits import PeerWarnings
from foundation.netutil import peer_address
from foundation.zmq_auth import secure_server
from transfer.affinity import pin_current_thread
from transfer.counters import Counters
from transfer.direct_exports import DirectExports
from transfer.kv_layout import LayoutMismatch, PagedKVCache, block_index_tensor
from transfer.leases import LeaseTable
from transfer.link_control import LINK_OPEN_SECONDS, ProducerControl
from transfer.pull_records import PullRecords
from transfer.send_buffers import SendBufferPool, send_frame
from transfer.shared_copies import local_host
from transfer.transports.base import Sender
from transfer.transports.checksums import frame_digest
from transfer.transports.errors import TransportError
from transfer.transports.handshake import SENDER
from transfer.transports.links import open_sender
from transfer.transports.nixl_agent import agent_for, nixl_missing
from transfer.transports.selection import hosted_backends
from transfer.transports.settings import TransportSettings

logger = logging.getLogger("kvroute.transfer.server")


MAX_LINKS = 64  # one per consumer that pulled from here; the oldest closes first
LINK_SEND_SECONDS = 10.0  # as a consumer's pull deadline: it stops waiting by then


@dataclass
class _ParkedPull:
    identity: bytes
    request: wire.PullBlocks | wire.PullOverLink
    give_up_at: float


class BlockServer:
    """Owns its socket and send buffers; reads ``cache`` only through leased blocks."""

    # A parked pull is retried every PARKED_POLL_MS until its lease appears. Otherwise the
    # thread sleeps until a request arrives or leases are due to expire: it shares the
    # process (and the GIL) with the engine's model runner, and waking every 5 ms while
    # idle slowed decode steps (4 concurrent 256-token streams on one unified engine on
    # 2 cores: 62 ms a token with the 5 ms wake-ups, 47-48 ms without).
    PARKED_POLL_MS = 5
    # While a consumer may be READing a lease directly, the agent is progressed this often: a
    # consumer's first READ from this agent connects, which waits for this end's progress.
    DIRECT_POLL_MS = 1
    EXPIRY_INTERVAL_SECONDS = 0.1

    def __init__(self, bind_address: str, cache: PagedKVCache, leases: LeaseTable,
                 counters: Counters, park_seconds: float = 5.0, pull_records: PullRecords | None = None,
                 context: zmq.Context | None = None, cpus: list[int] | None = None,
                 link_settings: TransportSettings | None = None, max_parked: int = 64):
        """``cpus``: where the server thread runs (default: where its creator runs);
        ``link_settings``: this end's side of the links consumers open (default: automatic);
        ``max_parked``: most pulls waiting for their lease grants at once."""
        self.cache = cache
        self.pull_records = pull_records or PullRecords()
        self.leases = leases
        self.counters = counters
        self.park_seconds = park_seconds
        self.max_parked = max_parked
        self._warnings = PeerWarnings(logger)
        self._context = context or zmq.Context.instance()
        self._cpus = cpus
        self._socket = secure_server(self._context.socket(zmq.ROUTER), "worker", transfer=True)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(bind_address)
        self._buffers = SendBufferPool()
        self._parked: list[_ParkedPull] = []  # at most max_parked, each for at most park_seconds
        self._peer: zmq.Frame | None = None  # the message being handled, to name its sender in warnings
        self.link_settings = link_settings or TransportSettings()
        self._links: OrderedDict[str, Sender] = OrderedDict()  # by the consumer's link id
        self.direct = DirectExports(cache, lambda: agent_for(SENDER, self.link_settings.host))
        # Direct READs are offered only by an end that hosts nixl; every producer stages into
        # its arena (transfer.connector_worker), so a region alone does not say it.
        self._offers_direct = "nixl" in hosted_backends(self.link_settings)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvroute-block-server", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=2)
        for sender in self._links.values():
            sender.close()
        self.direct.close()
        self._socket.close(linger=0)

    def _run(self) -> None:
        if self._cpus:
            pin_current_thread(self._cpus)
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        next_expiry = 0.0
        while not self._stopping.is_set():
            if poller.poll(self._poll_timeout_ms()):
                identity, *frames = self._socket.recv_multipart(copy=False)
                self._handle(identity, frames)
            now = time.monotonic()
            if now >= next_expiry:
                self._expire_leases(now)
                next_expiry = now + self.EXPIRY_INTERVAL_SECONDS
            self._retry_parked(now)
            self.direct.tend(now)

    def _poll_timeout_ms(self) -> float:
        if self.direct.pinned:
            return self.DIRECT_POLL_MS
        return self.PARKED_POLL_MS if self._parked else self.EXPIRY_INTERVAL_SECONDS * 1000

    def _expire_leases(self, now: float) -> None:
        for lease in self.leases.expire(now):
            if lease.pulled:
                logger.warning("lease for request %s was pulled but never acknowledged; freeing its blocks "
                               "at expiry", lease.request_id)
            else:
                logger.warning("lease for request %s expired unpulled; freeing its blocks", lease.request_id)

    def _handle(self, frame: zmq.Frame, frames: list[zmq.Frame]) -> None:
        """``frame``: the one carrying the peer's identity (and address); ``frames``: its message."""
        identity = frame.bytes
        try:
            if len(frames) != 1:
                raise wire.WireError(f"expected one frame, got {len(frames)}")
            message = wire.decode(frames[0].buffer)
        except wire.WireError as error:
            self._reply(identity, wire.ErrorReply(request_id=None, code="bad_request", message=str(error)))
            return
        self._peer = frame
        try:
            self._dispatch(identity, message)
        except Exception as error:  # the server must outlive any single bad request
            logger.exception("transfer request failed")
            self._reply(identity, wire.ErrorReply(request_id=None, code="internal", message=str(error)))

    def _dispatch(self, identity: bytes, message: wire.Message) -> None:
        if isinstance(message, (wire.PullBlocks, wire.PullOverLink)):
            self._start_pull(identity, message)
        elif isinstance(message, wire.ConfirmRead):
            live = self.leases.get(message.handle) is not None
            valid, error = self.direct.confirm(message.handle, message.pin, live, time.monotonic())
            self._reply(identity, wire.ConfirmReadReply(valid=valid, error=error))
        elif isinstance(message, wire.OpenLink):
            self._open_link(identity, message)
        elif isinstance(message, wire.ReleaseLease):
            released = self.leases.release(message.handle)
            if released:
                logger.debug("lease released (%s)", message.reason)
            self._reply(identity, wire.ReleaseReply(released=released))
        elif isinstance(message, wire.ReleaseAllLeases):
            count = self.leases.release_all()
            logger.info("released all %d leases (%s)", count, message.reason)
            self._reply(identity, wire.ReleaseReply(released=count > 0, count=count))
        elif isinstance(message, wire.PullRecordsRequest):
            self._reply(identity, wire.PullRecordsReply(records=self.pull_records.matching(message.request_id)))
        elif isinstance(message, wire.TransferStatsRequest):
            self._reply(identity, wire.TransferStatsReply(counters=self.snapshot(), layout=self.cache.spec))
        else:
            self._reply(identity, wire.ErrorReply(
                request_id=None, code="bad_request",
                message=f"unexpected message {type(message).__name__} on the transfer endpoint"))

    def snapshot(self) -> wire.TransferCounters:
        leases = self.leases
        return self.counters.snapshot(active_leases=len(leases), leases_granted=leases.num_granted,
                                      leases_released=leases.num_released, leases_expired=leases.num_expired,
                                      leases_staged=leases.num_staged, staged_bytes=leases.staged_bytes)

    def _open_link(self, identity: bytes, message: wire.OpenLink) -> None:
        """Run the link's first contact inline: a few small messages, for a torch.distributed
        link the wait for the consumer to join its group, and where "auto" measures, the
        probes of each candidate (``transfer.transports.probing``, bounded). What other peers
        sent meanwhile is handled afterwards, in order."""
        control = ProducerControl(self._socket, identity, message.link_id, message.payload)
        try:
            self._keep_link(message.link_id, open_sender(
                control, self.cache.spec, self.cache.device, time.monotonic() + LINK_OPEN_SECONDS,
                self.link_settings, zmq_context=self._context))
        except (TransportError, LayoutMismatch) as error:
            self._warnings.warn(peer_address(self._peer), "refused a transfer link: %s", error)
        for deferred_identity, frames in control.deferred:
            self._handle(deferred_identity, frames)

    def _keep_link(self, link_id: str, sender: Sender) -> None:
        self._links[link_id] = sender
        self.counters.add(links_opened=1)
        if sender.measurement is not None:
            self.counters.record_measurement(sender.measurement)
        while len(self._links) > MAX_LINKS:
            self._links.popitem(last=False)[1].close()
        logger.info("opened a %s link to a consumer (%d open)", sender.backend, len(self._links))

    def _start_pull(self, identity: bytes, request: wire.PullBlocks | wire.PullOverLink) -> None:
        if self.leases.has_expired(request.handle):
            self._refuse(identity, "lease expired before this pull; its blocks are freed")
            return
        if self.leases.get(request.handle) is None:
            if len(self._parked) >= self.max_parked:
                self._warnings.warn(peer_address(self._peer), "%d pulls already wait for their leases; refused "
                                    "one for an unknown handle", len(self._parked))
                self._refuse(identity, f"unknown handle, and {self.max_parked} pulls already wait for their leases")
                return
            self._parked.append(_ParkedPull(identity, request, time.monotonic() + self.park_seconds))
            return
        self._serve_pull(identity, request)

    def _retry_parked(self, now: float) -> None:
        if not self._parked:
            return
        waiting, self._parked = self._parked, []
        for parked in waiting:
            if self.leases.get(parked.request.handle) is not None:
                self._serve_pull(parked.identity, parked.request)
            elif parked.give_up_at <= now:
                self._refuse(parked.identity, "unknown or expired handle")
            else:
                self._parked.append(parked)

    def _serve_pull(self, identity: bytes, request: wire.PullBlocks | wire.PullOverLink) -> None:
        lease = self.leases.get(request.handle)
        if lease is None:
            self._refuse(identity, "unknown or expired handle")
            return
        try:
            self.cache.check_compatible(request.layout)
            block_ids = [lease.block_ids[i] for i in self._checked_indices(request, lease.block_ids)]
        except (LayoutMismatch, IndexError) as error:
            self._refuse(identity, str(error))
            return
        link = None
        if isinstance(request, wire.PullOverLink):
            link = self._links.get(request.link_id)
            if link is None or link.closed:
                self._links.pop(request.link_id, None)
                self._refuse(identity, "unknown or closed link; open a new one")
                return
        if self._offer_shared_copy(identity, request, lease) or self._offer_direct(identity, request, lease):
            return
        self._reply(identity, self._accepted(request))
        if link is not None:
            self._send_over_link(link, request, lease, block_ids)
        elif lease.staged is not None:
            self._send_staged(identity, lease, request.block_indices, request.checksum)
        else:
            self._send_layers(identity, block_ids, request.checksum)
        self.leases.mark_pulled(lease.handle)

    def _offer_shared_copy(self, identity: bytes, request: wire.PullBlocks | wire.PullOverLink, lease) -> bool:
        """Answer a consumer on this host with the staged copy itself; False: send frames."""
        if not (isinstance(request, wire.PullBlocks) and request.host and request.host == local_host()):
            return False
        ref = self._shared_ref(request, lease)
        if ref is None:
            return False
        count = len(request.block_indices)
        self._reply(identity, self._accepted(request, shared_copy=ref))
        self.counters.add(bytes_sent=count * self.cache.spec.bytes_per_block, blocks_sent=count, shared_pulls=1)
        self.leases.mark_pulled(lease.handle)
        return True

    def _shared_ref(self, request: wire.PullBlocks, lease) -> wire.SharedCopyRef | None:
        """The lease's copy as a consumer on this host opens it: its own memfd, or its region of
        the staging arena, pinned, for a consumer that confirms what it read there."""
        num_blocks = len(lease.block_ids)
        if lease.shared is not None:
            return lease.shared.ref(num_blocks)
        if lease.region is None or not request.confirms_shared or not lease.region.arena.shared:
            return None
        return lease.region.shared_ref(num_blocks, self.direct.pin(lease, time.monotonic()))

    def _offer_direct(self, identity: bytes, request: wire.PullBlocks | wire.PullOverLink, lease) -> bool:
        """Answer a consumer that READs with NIXL with where the lease lies in the staging arena;
        False: send frames (the lease is elsewhere, or NIXL cannot run here)."""
        if (not (isinstance(request, wire.PullBlocks) and request.direct and lease.region is not None)
                or not self._offers_direct or nixl_missing()):
            return False
        try:
            ref = self.direct.offer(lease, request.block_indices, request.checksum, time.monotonic())
        except Exception as error:  # noqa: BLE001 - NIXL refused to register the arena: frames still work
            self._warnings.warn(peer_address(self._peer), "cannot offer a lease for direct reads (%s); "
                                "sending frames", error)
            return False
        count = len(request.block_indices)
        self._reply(identity, self._accepted(request, direct=ref))
        self.counters.add(bytes_sent=count * self.cache.spec.bytes_per_block, blocks_sent=count, direct_pulls=1)
        self.leases.mark_pulled(lease.handle)
        return True

    def _accepted(self, request: wire.PullBlocks | wire.PullOverLink,
                  shared_copy: wire.SharedCopyRef | None = None,
                  direct: wire.DirectRef | None = None) -> wire.PullHeader:
        """The header that tells the consumer exactly what follows, for it to check
        (``transfer.pull_check``) before it writes anything."""
        spec, count = self.cache.spec, len(request.block_indices)
        return wire.PullHeader(ok=True, num_blocks=count, num_layers=spec.num_layers, shared_copy=shared_copy,
                               layout=spec, block_indices=list(request.block_indices),
                               frame_bytes=count * self.cache.layer_bytes_per_block,
                               checksum=request.checksum and shared_copy is None, direct=direct)

    @staticmethod
    def _checked_indices(request: wire.PullBlocks | wire.PullOverLink, leased: tuple[int, ...]) -> list[int]:
        for index in request.block_indices:
            if not 0 <= index < len(leased):
                raise IndexError(f"block index {index} outside the lease's {len(leased)} blocks")
        return request.block_indices

    def _send_layers(self, identity: bytes, block_ids: list[int], checksum: bool) -> None:
        index = block_index_tensor(block_ids)
        nbytes = len(block_ids) * self.cache.layer_bytes_per_block
        for layer in range(self.cache.spec.num_layers):
            slot, buffer = self._buffers.acquire(nbytes)
            self.cache.gather_layer(layer, index, buffer)
            self._buffers.mark_sent(slot, send_frame(self._socket, self._prefix(identity, buffer, checksum), buffer))
        self.counters.add(bytes_sent=nbytes * self.cache.spec.num_layers, blocks_sent=len(block_ids))

    def _send_over_link(self, link: Sender, request: wire.PullOverLink, lease, block_ids: list[int]) -> None:
        """One transfer over the consumer's link, gathered layer by layer into the link's
        own buffers; a failure closes the link (the consumer opens a new one)."""
        cache = self.cache
        frame_view = None
        if lease.staged is not None:
            positions = block_index_tensor(request.block_indices)
            fill = lambda layer, out: cache.select_from_copy(lease.staged[layer], positions, out)  # noqa: E731
            # A staged copy is never written again: a contiguous run of it goes out as it lies.
            first = _first_of_run(request.block_indices)
            if first is not None:
                count = len(request.block_indices)
                frame_view = lambda layer: cache.run_of_copy(lease.staged[layer], first, count)  # noqa: E731
        else:
            index = block_index_tensor(block_ids)
            fill = lambda layer, out: cache.gather_layer(layer, index, out)  # noqa: E731
        frame_bytes = [len(block_ids) * cache.layer_bytes_per_block] * cache.spec.num_layers
        try:
            sent = link.send(frame_bytes, fill, time.monotonic() + LINK_SEND_SECONDS, request.transfer_id,
                             frame_view, checksummed=request.checksum)
        except TransportError as error:
            logger.warning("%s link to a consumer failed while sending; closed it (%s)", link.backend, error)
            self._links.pop(request.link_id, None)
            return
        self.counters.add(bytes_sent=sent, blocks_sent=len(block_ids))

    def _send_staged(self, identity: bytes, lease, indices: list[int], checksum: bool) -> None:
        """Send from a staged lease. Its copies are never written again while it lives, so a
        contiguous run of blocks goes out zero-copy as it lies; other selections are gathered
        into send buffers first. A copy in the staging arena outlives its lease only while
        held, so its zero-copy sends are tracked and hold its region until they are done
        (a memfd or private copy lives as long as pyzmq's reference to it)."""
        cache, count, region = self.cache, len(indices), lease.region
        first = _first_of_run(indices)
        positions = None  # built once, only when some layer needs a gather
        for copy in lease.staged:
            run = cache.run_of_copy(copy, first, count) if first is not None else None
            if run is not None:
                tracker = send_frame(self._socket, self._prefix(identity, run, checksum), run, track=region is not None)
                if tracker is not None:
                    region.hold(tracker)
                continue
            if positions is None:
                positions = block_index_tensor(indices)
            slot, buffer = self._buffers.acquire(count * cache.layer_bytes_per_block)
            cache.select_from_copy(copy, positions, buffer)
            self._buffers.mark_sent(slot, send_frame(self._socket, self._prefix(identity, buffer, checksum), buffer))
        self.counters.add(bytes_sent=count * cache.layer_bytes_per_block * len(lease.staged), blocks_sent=count)

    @staticmethod
    def _prefix(identity: bytes, frame: torch.Tensor, checksum: bool) -> list[bytes]:
        """What goes before a frame: the consumer's identity, then the frame's digest if asked."""
        return [identity, frame_digest(frame)] if checksum else [identity]

    def _refuse(self, identity: bytes, reason: str) -> None:
        self._reply(identity, wire.PullHeader(ok=False, error=reason))

    def _reply(self, identity: bytes, message: wire._Message) -> None:
        self._socket.send_multipart([identity, wire.encode(message)])


def _first_of_run(indices: list[int]) -> int | None:
    """The first of ``indices`` when they are consecutive (an empty list is a run at 0), else None."""
    first = indices[0] if indices else 0
    return first if indices == list(range(first, first + len(indices))) else None
