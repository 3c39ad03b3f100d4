"""The node store process: one ROUTER socket in front of a ``NodeStore``.

Protocol (client: a DEALER; ``foundation.wire``)::

    TierLookup ──▶ TierLookupReply (how many leading blocks are held)
    TierPut [+ one frame of the blocks] ──▶ TierPutReply
    TierGet ──▶ TierGetReply [+ one frame per block, for a reader on another host]
    TierStatsRequest ──▶ TierStatsReply
    TierReset ──▶ TierResetReply (every block dropped: an operator's reset-cache)
    anything refused or malformed ──▶ ErrorReply, and the server stays up

It listens under the cluster's keys like a worker's transfer endpoint (the worker role's
server key; KV bytes, so ``--transfer-encryption`` applies), on loopback or ipc only. It
runs apart from every engine, so the blocks outlive an engine's restart; stopping it
(SIGTERM, SIGINT) frees its memory and empties its disk folder.
"""

from __future__ import annotations

import logging
import signal
import threading

import zmq

from foundation import wire, zmq_auth
from foundation.log_setup import LOG_FORMAT
from transfer.node_store.settings import NodeStoreSettings
from transfer.node_store.store import NodeStore, RequestRefused

logger = logging.getLogger("kvroute.node_store.server")

POLL_MS = 100  # how often the loop looks at its stop flag
MAX_MESSAGE_BYTES = 1 << 30  # a put of blocks as a frame (readers on another host)


class NodeStoreServer:
    """Owns its socket and its store; ``serve`` runs on one thread (the caller's, or
    ``start``'s)."""

    def __init__(self, settings: NodeStoreSettings, context: zmq.Context | None = None):
        self.store = NodeStore(settings)
        self._context = context or zmq.Context.instance()
        self._socket = zmq_auth.secure_server(self._context.socket(zmq.ROUTER), "worker", transfer=True)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._socket.bind(settings.bind)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> NodeStoreServer:
        self._thread = threading.Thread(target=self.serve, name="kvroute-node-store", daemon=True)
        self._thread.start()
        return self

    def request_stop(self) -> None:
        """Ends ``serve`` within a poll interval; safe from a signal handler."""
        self._stopping.set()

    def stop(self) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def serve(self) -> None:
        try:
            while not self._stopping.is_set():
                if self._socket.poll(POLL_MS):
                    identity, *frames = self._socket.recv_multipart(copy=False)
                    self._socket.send_multipart([identity, *self._answer(frames)], copy=False)
        finally:
            self._socket.close(linger=0)
            self.store.close()

    def _answer(self, frames: list[zmq.Frame]) -> list:
        try:
            message = wire.decode(frames[0].buffer)
            reply, data = self._dispatch(message, frames[1].buffer if len(frames) == 2 else None)
        except (wire.WireError, RequestRefused) as error:
            code = getattr(error, "code", "bad_request")
            return [wire.encode(wire.ErrorReply(request_id=None, code=code, message=str(error)))]
        except Exception as error:  # the store must outlive any single bad request
            logger.exception("node store request failed")
            return [wire.encode(wire.ErrorReply(request_id=None, code="internal", message=str(error)))]
        return [wire.encode(reply), *[memoryview(block) for block in data]]

    def _dispatch(self, message: wire.Message, frame: memoryview | None) -> tuple[wire._Message, list]:
        store = self.store
        if isinstance(message, wire.TierLookup):
            return store.lookup(message), []
        if isinstance(message, wire.TierPut):
            return store.put(message, frame), []
        if isinstance(message, wire.TierGet):
            return store.get(message)
        if isinstance(message, wire.TierStatsRequest):
            return store.stats(), []
        if isinstance(message, wire.TierReset):
            return store.reset(), []
        if isinstance(message, wire.TierEventsRequest):
            return store.events(message), []
        raise RequestRefused(f"unexpected message {type(message).__name__} at a node store", code="bad_request")


def run_node_store(settings: NodeStoreSettings, cluster_keys: str, insecure_no_auth: bool,
                   transfer_encryption: bool, ready=None) -> None:
    """The ``kvroute node-store`` process: serve until SIGTERM or SIGINT. ``ready``: called
    with the bound address once it serves."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    zmq_auth.configure_from_flags(cluster_keys, insecure_no_auth, "worker", transfer_encryption)
    server = NodeStoreServer(settings)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.request_stop())
    disk = f", {settings.disk_kv_gib:.3g} GiB on disk under {settings.disk_kv_dir}" if settings.disk_kv_gib else ""
    logger.info("node store serving on %s: %.3g GiB of host memory%s", server.address, settings.host_kv_gib, disk)
    if ready is not None:
        ready(server.address)
    server.serve()
    logger.info("node store stopped")
