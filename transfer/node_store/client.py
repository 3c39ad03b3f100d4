"""Talking to a node store (``transfer.node_store.server``) from an engine's connector.

Every exchange has a deadline: ZeroMQ never reports a dead peer. A store that misses one
is left alone for ``backoff_seconds``, in which every call fails at once: a dead store
costs one request a short wait (the lookup's timeout) and the rest nothing but the
recompute of what the store would have given them. Torch-free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from foundation import wire
from foundation.endpoint_client import ChannelPool, PullFailed

LOOKUP_TIMEOUT_SECONDS = 0.05  # on the engine's scheduler thread: each new request may wait this long
TIMEOUT_SECONDS = 5.0  # puts and gets, on the connector's own threads
BACKOFF_SECONDS = 5.0

logger = logging.getLogger(__name__)


class StoreUnavailable(RuntimeError):
    """The store did not answer in time, or is being left alone after it did not."""


class StoreRefused(RuntimeError):
    """The store answered with a refusal (``code`` says why)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class NodeStoreClient:
    """Thread-safe: each exchange takes a channel of its own from the pool."""

    def __init__(self, address: str, context: zmq.Context | None = None,
                 lookup_timeout: float = LOOKUP_TIMEOUT_SECONDS, timeout: float = TIMEOUT_SECONDS,
                 backoff_seconds: float = BACKOFF_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.address = address
        self.lookup_timeout = lookup_timeout
        self.timeout = timeout
        self.backoff_seconds = backoff_seconds
        self.clock = clock
        self._channels = ChannelPool(context or zmq.Context.instance())
        self._lock = threading.Lock()
        self._left_alone_until = 0.0

    def leading(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, the store holds; 0 when it cannot say in time."""
        if not keys:
            return 0
        try:
            reply, _ = self._exchange(wire.TierLookup(keys=keys), wire.TierLookupReply, self.lookup_timeout)
        except (StoreUnavailable, StoreRefused):
            return 0
        return max(0, min(reply.num_leading, len(keys)))

    def put(self, keys: list[bytes], layout: wire.KVLayoutSpec, copy: wire.SharedCopyRef | None,
            data: memoryview) -> wire.TierPutReply:
        """Store the blocks staged in ``data`` (shared as ``copy`` when given); a store that
        cannot open the copy gets them as a frame."""
        if copy is not None:
            try:
                return self._exchange(wire.TierPut(keys=keys, layout=layout, copy=copy), wire.TierPutReply)[0]
            except StoreRefused as error:
                if error.code != "copy_unavailable":
                    raise
        return self._exchange(wire.TierPut(keys=keys, layout=layout), wire.TierPutReply, payload=data)[0]

    def get(self, keys: list[bytes], layout: wire.KVLayoutSpec, host: str) -> tuple[wire.TierGetReply, list]:
        """Where the blocks lie, and the frames that carry them when the store cannot share its memory."""
        return self._exchange(wire.TierGet(keys=keys, layout=layout, host=host), wire.TierGetReply, frames=len(keys))

    def stats(self, timeout: float | None = None) -> wire.TierStatsReply:
        return self._exchange(wire.TierStatsRequest(), wire.TierStatsReply, timeout)[0]

    def events(self, since: int, epoch: str, timeout: float | None = None) -> wire.TierEventsReply:
        """What the store stored and removed after event ``since`` of run ``epoch``, or a snapshot."""
        return self._exchange(wire.TierEventsRequest(since=since, epoch=epoch), wire.TierEventsReply, timeout)[0]

    def reset(self) -> wire.TierResetReply:
        """Drop every block the store holds."""
        return self._exchange(wire.TierReset(), wire.TierResetReply)[0]

    def close(self) -> None:
        self._channels.close()

    @property
    def available(self) -> bool:
        with self._lock:
            return self.clock() >= self._left_alone_until

    def _exchange(self, message: wire._Message, reply_type: type, timeout: float | None = None,
                  payload: memoryview | None = None, frames: int = 0) -> tuple:
        """(reply, the frames after it when the reply says they follow)."""
        if not self.available:
            raise StoreUnavailable(f"the node store at {self.address} did not answer recently")
        deadline = self.clock() + (self.timeout if timeout is None else timeout)
        try:
            with self._channels.channel(self.address, deadline) as channel:
                channel.socket.send_multipart([wire.encode(message), *([payload] if payload is not None else [])],
                                              copy=payload is None)
                reply = channel.receive_message()
                if isinstance(reply, wire.ErrorReply):
                    raise StoreRefused(reply.code, reply.message)
                if not isinstance(reply, reply_type):
                    raise StoreRefused("unexpected", f"a {type(reply).__name__} answered a {type(message).__name__}")
                follows = frames if isinstance(reply, wire.TierGetReply) and not reply.arenas else 0
                return reply, [channel.receive_frame() for _ in range(follows)]
        except (PullFailed, wire.WireError) as error:
            with self._lock:
                self._left_alone_until = self.clock() + self.backoff_seconds
            # Says why the prompts of the next few seconds compute what the store may hold.
            logger.warning("node store at %s missed a %s (%s); left alone for %.0f s",
                           self.address, type(message).__name__, error, self.backoff_seconds)
            raise StoreUnavailable(f"the node store at {self.address} did not answer: {error}") from error
