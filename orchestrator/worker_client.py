"""Asyncio client of one worker's RPC: streamed generate, abort, stats.

One DEALER socket per worker, read by an event-loop reader callback that routes each
reply to its request's queue. Every wait has a timeout, because ZeroMQ never reports a
dead peer.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from foundation import wire
from foundation.netutil import async_context
from foundation.zmq_auth import secure_client
from orchestrator.retry import RetryPolicy, with_retries

logger = logging.getLogger("kvroute.orchestrator.client")


class WorkerError(RuntimeError):
    """The worker answered a request with an error."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class WorkerTimeout(WorkerError):
    def __init__(self, message: str):
        super().__init__("timeout", message)


SEND_TIMEOUT = 10.0  # seconds a full send queue may block one message
SEND_RETRY_SECONDS = 0.005

# Not worth another attempt: the request was wrong, or this client was closed for good.
FINAL_CODES = frozenset({"bad_request", "invalid_request", "duplicate", "worker_down"})


def retryable(error: Exception) -> bool:
    return isinstance(error, WorkerError) and error.code not in FINAL_CODES


class WorkerClient:
    """Owned by one event loop; ``_queues`` is written only by that loop. ``retry``: how
    the idempotent calls (stats, snapshot, reset_cache) are retried; generate never is."""

    def __init__(self, address: str, context: zmq.asyncio.Context | None = None,
                 retry: RetryPolicy = RetryPolicy()):
        self.address = address
        self.retry = retry
        self._context = context or async_context()
        self._socket = secure_client(self._context.socket(zmq.DEALER), "worker")
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        # Sends and receives go through the same socket without the asyncio wrapper: per
        # message, its futures cost more than the ZeroMQ call itself. The socket's file
        # descriptor is edge-triggered, so the reader drains until no message is left, and
        # every send, which may consume a readiness signal, is followed by a drain.
        self._direct = zmq.Socket.shadow(self._socket.underlying)
        self._loop = asyncio.get_running_loop()
        self._fd = self._direct.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)
        self._queues: dict[str, asyncio.Queue] = {}
        # ZeroMQ hides a dead peer, but the TCP connection's end is visible on a monitor:
        # a worker process that died fails its requests now, not at the heartbeat timeout.
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.connection_lost = False  # since the last disconnect, no peer completed a handshake
        self._watcher = asyncio.create_task(self._watch_connection())

    async def close(self) -> None:
        """Stop receiving; every request still waiting on this worker fails at once."""
        self._watcher.cancel()
        await asyncio.gather(self._watcher, return_exceptions=True)
        self._loop.remove_reader(self._fd)
        self._fail_waiting("worker_down", f"{self.address} was marked down")
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)

    def _fail_waiting(self, code: str, message: str) -> None:
        for request_id, queue in self._queues.items():
            queue.put_nowait(wire.ErrorReply(request_id=request_id, code=code, message=message))

    async def _watch_connection(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self.connection_lost:
                    logger.info("connection to worker %s is back", self.address)
                self.connection_lost = False
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connection_lost = True
                # Replies to requests sent over the lost connection can never arrive: the
                # worker's socket routes by connection. ZeroMQ reconnects for new requests.
                logger.warning("connection to worker %s lost; failing its %d requests in flight",
                               self.address, len(self._queues))
                self._fail_waiting("worker_disconnected", f"connection to {self.address} lost")

    def _drain(self) -> None:
        if self._direct.closed:
            return
        while self._direct.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._route(self._direct.recv(zmq.NOBLOCK))

    def _route(self, frame: bytes) -> None:
        try:
            message = wire.decode(frame)
        except wire.WireError as error:
            logger.warning("undecodable reply from %s: %s", self.address, error)
            return
        queue = self._queues.get(getattr(message, "request_id", None) or "")
        if queue is not None:
            queue.put_nowait(message)

    async def _send(self, message: wire._Message) -> None:
        frame = wire.encode(message)
        deadline = None
        while True:
            try:
                self._direct.send(frame, zmq.NOBLOCK)
                break
            except zmq.Again:  # the queue to the worker is full (its high-water mark)
                now = self._loop.time()
                deadline = deadline or now + SEND_TIMEOUT
                if now > deadline:
                    raise WorkerTimeout(f"{self.address} took no message for {SEND_TIMEOUT:.0f} s") from None
                await asyncio.sleep(SEND_RETRY_SECONDS)
        self._drain()

    async def generate(self, request: wire.GenerateRequest, timeout: float = 60.0,
                       on_timeout: Callable[[WorkerTimeout], None] | None = None) -> AsyncIterator[wire.GenerateChunk]:
        """Stream the request's chunks; abort it on the worker if the caller stops early.
        ``on_timeout``: called when ``timeout`` passes with no chunk; it returns to wait
        another ``timeout`` and raises to give up (default: give up)."""
        queue = self._open(request.request_id)
        finished = False
        try:
            await self._send(request)
            while not finished:
                try:
                    chunk = await self._next(queue, timeout, request.request_id)
                except WorkerTimeout as error:
                    if on_timeout is None:
                        raise
                    on_timeout(error)
                    continue
                finished = chunk.finished
                yield chunk
        finally:
            self._queues.pop(request.request_id, None)
            if not finished:
                await self.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        if not self._socket.closed:  # a closed client's worker is gone or replaced
            await self._send(wire.AbortRequest(request_id=request_id))

    async def stats(self, timeout: float = 5.0) -> wire.WorkerStats:
        return await self._call(wire.StatsRequest, wire.WorkerStats, timeout)

    async def snapshot(self, timeout: float = 30.0) -> wire.KVSnapshot:
        """The worker's resident prefix-cache blocks and the KV-event seq they reflect."""
        return await self._call(wire.SnapshotRequest, wire.KVSnapshot, timeout)

    async def reset_cache(self, timeout: float = 30.0) -> wire.ResetCacheReply:
        return await self._call(wire.ResetCacheRequest, wire.ResetCacheReply, timeout)

    async def tier_events(self, since: int, epoch: str, timeout: float = 5.0) -> wire.TierEventsReply:
        """The worker's node store's events after ``since`` of run ``epoch`` (or its
        snapshot). One attempt: the caller asks again at its next poll."""
        return await self._call_once(wire.TierEventsRequest, wire.TierEventsReply, timeout, since=since, epoch=epoch)

    async def _call(self, request_type, reply_type, timeout: float):
        """An idempotent query: each attempt waits up to ``timeout``, then backs off and asks again."""
        return await with_retries(lambda: self._call_once(request_type, reply_type, timeout), self.retry,
                                  f"{request_type.__name__} to {self.address}", retryable)

    async def _call_once(self, request_type, reply_type, timeout: float, **fields):
        """One request (with ``fields``), one reply, correlated by a fresh request id."""
        request_id = f"{request_type.__name__}-{uuid.uuid4().hex}"
        queue = self._open(request_id)
        try:
            await self._send(request_type(request_id=request_id, **fields))
            reply = await self._wait(queue, timeout, request_id)
        finally:
            self._queues.pop(request_id, None)
        if not isinstance(reply, reply_type):
            raise WorkerError("bad_reply", f"expected {reply_type.__name__}, got {type(reply).__name__}")
        return reply

    def _open(self, request_id: str) -> asyncio.Queue:
        if request_id in self._queues:
            raise WorkerError("duplicate", f"request {request_id} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    async def _next(self, queue: asyncio.Queue, timeout: float, request_id: str) -> wire.GenerateChunk:
        message = await self._wait(queue, timeout, request_id)
        if isinstance(message, wire.ErrorReply):
            raise WorkerError(message.code, message.message)
        if not isinstance(message, wire.GenerateChunk):
            raise WorkerError("bad_reply", f"expected a chunk, got {type(message).__name__}")
        return message

    async def _wait(self, queue: asyncio.Queue, timeout: float, request_id: str) -> wire.Message:
        if not queue.empty():
            return queue.get_nowait()
        try:
            async with asyncio.timeout(timeout):  # unlike wait_for, no task per wait
                return await queue.get()
        except TimeoutError:
            raise WorkerTimeout(f"{self.address} sent nothing for {request_id} in {timeout:.0f} s") from None
