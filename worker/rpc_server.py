"""The worker's ZMQ RPC: generate (streamed), abort, stats. One ROUTER socket.

Each ``GenerateRequest`` becomes an asyncio task that streams ``GenerateChunk``s to
the caller's identity until vLLM finishes the request; ``AbortRequest`` cancels it.
Malformed frames get an ``ErrorReply``; nothing a client sends stops the server.
Once draining (``start_draining``), a new generate is refused with code ``draining``,
so the caller places it on another worker; the ones running carry on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from foundation import wire, zmq_auth
from foundation.log_limits import PeerWarnings
from foundation.netutil import async_context
from foundation.zmq_auth import peer_role, secure_server
from worker.generation import engine_prompt, sampling_params, to_chunk
from worker.queued_prefill import QueuedPrompt
from worker.request_spans import request_spans

logger = logging.getLogger("kvroute.worker.rpc")

REPLY_FLUSH_MS = 2000  # how long queued replies may still be sent after the server closes
DRAINING = "draining"  # the error code of a generate refused because the worker is stopping

StatsProvider = Callable[[], Awaitable[wire.WorkerStats]]
SnapshotProvider = Callable[[str], wire.KVSnapshot]
ResetHandler = Callable[[str], Awaitable[wire.ResetCacheReply]]
TransferLookup = Callable[[str], Awaitable[wire.PullRecord | None]]
TierEventsProvider = Callable[[wire.TierEventsRequest], Awaitable[wire.TierEventsReply]]


class RpcServer:
    """Owns the socket and the table of running generate tasks."""

    def __init__(self, engine, bind_address: str, stats: StatsProvider, snapshot: SnapshotProvider,
                 reset_cache: ResetHandler, transfer_of: TransferLookup, model: str = "",
                 tier_events: TierEventsProvider | None = None,
                 priority_of: Callable[[QueuedPrompt], int] | None = None):
        """``model``: the engine's model (folder or hub id), named in the request spans;
        ``tier_events``: its node store's events, passed on (None: it has no store);
        ``priority_of``: each request's priority for the engine (worker.prompt_priority; None: 0)."""
        self.engine = engine
        self.model = model
        self._stats = stats
        self._snapshot = snapshot
        self._reset_cache = reset_cache
        self._transfer_of = transfer_of
        self._tier_events = tier_events
        self._priority_of = priority_of or (lambda prompt: 0)
        self._context = async_context()
        self._socket = secure_server(self._context.socket(zmq.ROUTER), "worker")
        self._socket.setsockopt(zmq.LINGER, 0)
        # A reply to a caller whose connection is gone fails instead of vanishing, so a
        # request of an orchestrator that died is aborted, not run to max_tokens for nobody.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.bind(bind_address)
        self._tasks: dict[str, asyncio.Task] = {}
        self._queries: set[asyncio.Task] = set()  # stats, snapshot and reset answers in progress
        self.prompts_waiting: dict[str, QueuedPrompt] = {}  # accepted, no output yet
        self.draining = False
        # Pull sources handed to callers, each naming a lease the connector grants: a
        # draining producer compares this with the grants to know none is still on its way.
        self.num_pull_sources_sent = 0
        self._refused_peers = 0  # messages from members that are not an orchestrator
        self._peer_warnings = PeerWarnings(logger)
        self._idle = asyncio.Event()  # set while no generate runs
        self._idle.set()

    @property
    def num_active_requests(self) -> int:
        return len(self._tasks)

    def start_draining(self) -> None:
        self.draining = True

    async def wait_idle(self) -> None:
        """Until no generate runs (right away when none does)."""
        await self._idle.wait()

    async def serve(self) -> None:
        try:
            while True:
                identity, *frames = await self._socket.recv_multipart(copy=False)
                if not self._from_orchestrator(frames):
                    await self._send(identity.bytes, wire.ErrorReply(
                        request_id=None, code="forbidden", message="only an orchestrator may use a worker's RPC"))
                    continue
                try:
                    await self._handle(identity.bytes, [frame.bytes for frame in frames])
                except Exception:  # nothing a client sends may stop the server
                    logger.exception("RPC handling failed")
        finally:
            await self.close()

    def _from_orchestrator(self, frames: list[zmq.Frame]) -> bool:
        """Under CURVE, whether the sender holds the orchestrator's key (a worker's key may
        pull KV from a worker's transfer endpoint, never generate or read its cache)."""
        if not zmq_auth.current().enabled:
            return True
        role = peer_role(frames[-1]) if frames else None
        if role == "orchestrator":
            return True
        self._refused_peers += 1
        self._peer_warnings.warn(f"a {role} key", "refused an RPC message: only an orchestrator may use a "
                                 "worker's RPC (%d refused in all)", self._refused_peers)
        return False

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *self._queries]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Replies already sent (a drained request's last chunk) may still be queued: keep
        # them for the context's flush at exit (``flush_async_context``).
        self._socket.close(linger=REPLY_FLUSH_MS)

    async def _handle(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            if len(frames) != 1:
                raise wire.WireError(f"expected one frame, got {len(frames)}")
            message = wire.decode(frames[0])
        except wire.WireError as error:
            self._peer_warnings.warn(f"connection {identity.hex()}", "malformed RPC frame: %s", error)
            request_id = wire.peek_request_id(frames[0]) if len(frames) == 1 else None
            await self._send(identity, wire.ErrorReply(request_id=request_id, code="bad_request",
                                                       message=str(error)))
            return
        if isinstance(message, wire.GenerateRequest):
            self._start_generate(identity, message)
        elif isinstance(message, wire.AbortRequest):
            await self._abort(message.request_id)
        elif isinstance(message, (wire.StatsRequest, wire.SnapshotRequest, wire.ResetCacheRequest,
                                  wire.TierEventsRequest)):
            # Slow (a reset waits for the engine): answered by a task so the loop keeps serving.
            self._spawn(self._answer(identity, message))
        else:
            await self._send(identity, wire.ErrorReply(
                request_id=None, code="bad_request", message=f"unexpected {type(message).__name__}"))

    async def _answer(self, identity: bytes, message: wire.Message) -> None:
        try:
            if isinstance(message, wire.StatsRequest):
                reply = await self._stats()
                reply.request_id = message.request_id
            elif isinstance(message, wire.SnapshotRequest):
                reply = self._snapshot(message.request_id)
            elif isinstance(message, wire.TierEventsRequest):
                if self._tier_events is None:
                    raise ValueError("this worker has no node store")
                reply = await self._tier_events(message)
            else:
                reply = await self._reset_cache(message.request_id)
        except Exception as error:  # a failing query must never take the worker down
            logger.warning("%s failed: %s", type(message).__name__, error)
            reply = wire.ErrorReply(request_id=message.request_id, code="unavailable", message=str(error))
        await self._send(identity, reply)

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._queries.add(task)
        task.add_done_callback(self._queries.discard)

    def _start_generate(self, identity: bytes, request: wire.GenerateRequest) -> None:
        refusal = self._refusal(request)
        if refusal is not None:
            asyncio.ensure_future(self._send(identity, refusal))
            return
        task = asyncio.create_task(self._generate(identity, request))
        self._tasks[request.request_id] = task
        self._idle.clear()
        task.add_done_callback(lambda _: self._forget(request.request_id, task))

    def _refusal(self, request: wire.GenerateRequest) -> wire.ErrorReply | None:
        """Why ``request`` does not start here, or None. An invalid request is refused as
        such even while draining: another worker would refuse it too."""
        problem = validate(request)
        if problem is None and request.request_id in self._tasks:
            problem = f"request id {request.request_id!r} is already running"
        if problem is not None:
            return wire.ErrorReply(request_id=request.request_id, code="invalid_request", message=problem)
        if self.draining:
            return wire.ErrorReply(request_id=request.request_id, code=DRAINING,
                                   message="this worker is stopping and takes no new requests")
        return None

    def _forget(self, request_id: str, task: asyncio.Task) -> None:
        if self._tasks.get(request_id) is task:
            del self._tasks[request_id]
        self.prompts_waiting.pop(request_id, None)
        if not self._tasks:
            self._idle.set()

    async def _generate(self, identity: bytes, request: wire.GenerateRequest) -> None:
        request_id = request.request_id
        prompt = self.prompts_waiting[request_id] = QueuedPrompt(request)
        spans = request_spans(request, self.model)
        try:
            stream = self.engine.generate(engine_prompt(request), sampling_params(request), request_id,
                                          priority=self._priority_of(prompt))
            first = True
            async for output in stream:
                self.prompts_waiting.pop(request_id, None)
                chunk = to_chunk(request_id, output)
                if chunk.pull_source is not None:
                    self.num_pull_sources_sent += 1
                if first and request.pull_from is not None:
                    chunk.transfer = await self._transfer_of(request_id)
                first = False
                spans.observe(chunk)
                if not await self._send(identity, chunk):
                    logger.info("request %s: its caller is gone; aborting it", request_id)
                    spans.fail("caller_gone")
                    await self.engine.abort(request_id)
                    return
        except asyncio.CancelledError:
            spans.fail("aborted")
            raise
        except Exception as error:  # an engine error fails this request, not the worker
            logger.warning("request %s failed: %s", request_id, error)
            spans.fail(error)
            await self._send(identity, wire.ErrorReply(request_id=request_id, code=error_code(error),
                                                       message=str(error)))
        finally:
            spans.finish()

    async def _abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is None:
            return
        await self.engine.abort(request_id)
        task.cancel()
        logger.info("aborted request %s", request_id)

    async def _send(self, identity: bytes, message: wire._Message) -> bool:
        """False when the caller's connection is gone (nobody is left to read the message)."""
        try:
            await self._socket.send_multipart([identity, wire.encode(message)])
        except zmq.ZMQError as error:
            if error.errno != zmq.EHOSTUNREACH:
                raise
            return False
        return True


def validate(request: wire.GenerateRequest) -> str | None:
    """A reason to refuse the request before it reaches the engine, or None."""
    if not request.prompt_token_ids:
        return "prompt_token_ids is empty"
    if any(token < 0 for token in request.prompt_token_ids):
        return "prompt_token_ids contains a negative id"
    if request.sampling.max_tokens < 1:
        return "max_tokens must be at least 1"
    return None


def error_code(error: Exception) -> str:
    return "invalid_request" if isinstance(error, (ValueError, TypeError)) else "engine_error"
