"""The asyncio shell around the registry: the registration endpoint and worker clients.

Workers push heartbeats to a ROUTER socket; each is handed to ``WorkerRegistry`` and
answered with a ``RegisterReply``. A ``WorkerClient`` exists for every live worker
incarnation and is closed when the worker is marked down or restarts. A circuit
breaker per worker (``circuit_breaker``) keeps one that fails its requests out of
planning until a probe request succeeds.

The registration socket faces every process that can reach its port, so no frame may
end its receive loop: each message is handled in its own ``try``, and one that is
malformed, oversized (over ``max_frame_bytes``, dropped by libzmq before it is read)
or refused costs one rate-limited warning naming the peer's address. State keyed by
ids that peers choose is bounded: refused ids in an LRU, registered workers by the
registry's cap. A worker that leaves (marked down) takes its per-worker state with it:
listeners hear ``worker_left``, and counts recreated for it afterwards (a request that
ended late) are swept on the next expiry round.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq

from foundation import wire
from foundation.log_limits import PeerWarnings
from foundation.lru import LruDict
from foundation.netutil import async_context, peer_address
from foundation.zmq_auth import secure_server
from orchestrator.circuit_breaker import BreakerSettings, CircuitBreakers
from orchestrator.load_ledger import LoadLedger
from orchestrator.registry import Verdict, WorkerRegistry, WorkerView
from orchestrator.retry import RetryPolicy
from orchestrator.worker_client import WorkerClient

logger = logging.getLogger("kvroute.orchestrator.fleet")

DEFAULT_MAX_FRAME_BYTES = 1 << 20  # a heartbeat listing ten thousand queued requests is ~0.5 MB
REMEMBERED_REFUSALS = 1024  # refused worker ids whose refusal was logged (logged again once forgotten)


class Fleet:
    """Owns the registry, the clients, the in-flight request counts per worker, the
    ledger that reconciles heartbeats with this orchestrator's own dispatches, and the
    circuit breakers (which the completion service feeds with each request's outcome)."""

    def __init__(self, registry: WorkerRegistry, bind_address: str, orchestrator_id: str,
                 breaker_settings: BreakerSettings = BreakerSettings(), retry: RetryPolicy = RetryPolicy(),
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.registry = registry
        self.breakers = CircuitBreakers(breaker_settings)
        self._retry = retry
        self.orchestrator_id = orchestrator_id
        self._bind_address = bind_address
        self._clients: dict[str, WorkerClient] = {}
        self._in_flight: dict[str, int] = {}
        self.ledger = LoadLedger()
        self.max_frame_bytes = max_frame_bytes
        self.refused: LruDict[str, str] = LruDict(REMEMBERED_REFUSALS)  # worker id -> reason last logged
        self._warnings = PeerWarnings(logger)
        self._tasks: list[asyncio.Task] = []
        self._socket = None
        # Told about every worker incarnation that comes up or goes down (e.g. the index).
        self.listeners: list = []

    async def start(self) -> None:
        self._socket = secure_server(async_context().socket(zmq.ROUTER), "orchestrator")
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)  # libzmq drops the sender's connection
        self._socket.bind(self._bind_address)
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._expire_loop())]
        logger.info("workers register at %s", self._bind_address)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
        if self._socket is not None:
            self._socket.close(linger=0)

    # ------------------------------------------------------------ queries

    def live(self, role: str) -> list[WorkerView]:
        """Registered, heartbeating, reachable, not draining and not failing: a worker whose RPC
        connection broke is left out until it is back, so no request waits on a process that
        died; one that is draining for good, as it is about to stop; and one whose circuit
        breaker is open until its cool-down let a probe succeed."""
        now = time.monotonic()
        return [w for w in self.registry.live(role)
                if self._reachable(w.worker_id) and not w.draining and self.breakers.allows(w.worker_id, now)]

    def pool(self, pool: str) -> list[WorkerView]:
        """The live workers of the planner's ``pool`` (``wire.POOLS``): those of that role,
        and the unified workers, which are in both."""
        return [w for role in wire.ROLES if wire.serves(role, pool) for w in self.live(role)]

    def draining(self, role: str) -> list[WorkerView]:
        """Reachable workers that are draining: out of planning, finishing what they have.
        One that stopped leaves this list when its connection drops."""
        return [w for w in self.registry.live(role) if w.draining and self._reachable(w.worker_id)]

    def _reachable(self, worker_id: str) -> bool:
        client = self._clients.get(worker_id)
        return client is not None and not client.connection_lost

    def client(self, worker_id: str) -> WorkerClient | None:
        return self._clients.get(worker_id)

    def in_flight(self, worker_id: str) -> int:
        return self._in_flight.get(worker_id, 0)

    def can_serve(self) -> bool:
        return all(self.pool(pool) for pool in wire.POOLS)

    def track(self, worker_id: str, delta: int) -> None:
        # Requests started before a worker was dropped and re-registered still finish
        # against it; never let them drive the count below zero, nor keep a zero for it.
        count = max(0, self._in_flight.get(worker_id, 0) + delta)
        if count:
            self._in_flight[worker_id] = count
        else:
            self._in_flight.pop(worker_id, None)
        if delta > 0:  # a half-open breaker lets this one through as its probe, and no other
            self.breakers.dispatched(worker_id, time.monotonic())

    # ------------------------------------------------------------ the shell

    async def _receive_loop(self) -> None:
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            try:
                await self._handle(frames)
            except Exception as error:  # no frame may end the loop: every worker would expire
                self._warnings.warn(peer_address(frames[0]), "registration message dropped: %s", error)

    async def _handle(self, frames: list[zmq.Frame]) -> None:
        identity, *body = frames
        if len(body) != 1:
            raise wire.WireError(f"expected one frame after the identity, got {len(body)}")
        beat = wire.decode(body[0].buffer)
        if not isinstance(beat, wire.Heartbeat):
            raise wire.WireError(f"expected a heartbeat, got {type(beat).__name__}")
        verdict = self.registry.observe(beat, time.monotonic())
        try:
            await self._apply(beat, verdict, peer_address(identity))
        except Exception:
            if verdict.accepted:  # half applied: forget it all, so its next beat registers it afresh
                self.registry.remove(beat.worker_id)
                await self._drop(beat.worker_id, departed=True)
            raise
        reply = wire.RegisterReply(accepted=verdict.accepted, reason=verdict.reason,
                                   orchestrator_id=self.orchestrator_id)
        await self._socket.send_multipart([identity.bytes, wire.encode(reply)])

    async def _apply(self, beat: wire.Heartbeat, verdict: Verdict, peer: str) -> None:
        if not verdict.accepted:
            self._note_refusal(beat, verdict, peer)
            return
        self.refused.pop(beat.worker_id, None)
        self.ledger.heartbeat(beat.worker_id)
        if verdict.replaced is not None:
            await self._drop(verdict.replaced.worker_id, departed=False)
        if verdict.is_new:
            client = self._clients[beat.worker_id] = WorkerClient(beat.rpc_address, retry=self._retry)
            view = self.registry.get(beat.worker_id)
            for listener in self.listeners:
                listener.worker_up(view, client)

    def _note_refusal(self, beat: wire.Heartbeat, verdict: Verdict, peer: str) -> None:
        """Logged once per worker id and reason (a refused worker beats every second), and
        at most once per interval per peer (a flood of ids would log each once)."""
        worker_id = beat.worker_id[:128]
        if self.refused.get(worker_id) == verdict.reason:
            return
        self.refused[worker_id] = verdict.reason
        detail = f" ({verdict.detail})" if verdict.detail else ""
        self._warnings.warn(peer, "refusing worker %r: %s%s", worker_id, verdict.reason, detail)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.registry.heartbeat_timeout / 2))
            for worker in self.registry.expire(time.monotonic()):
                await self._drop(worker.worker_id, departed=True)
            self._sweep_departed()

    async def _drop(self, worker_id: str, departed: bool) -> None:
        """``departed``: the worker left the fleet (else a new incarnation replaces it)."""
        for listener in self.listeners:
            listener.worker_down(worker_id)
            if departed:
                listener.worker_left(worker_id)
        client = self._clients.pop(worker_id, None)
        self._in_flight.pop(worker_id, None)
        self.ledger.forget(worker_id)
        self.breakers.forget(worker_id)
        if client is not None:
            await client.close()

    def _sweep_departed(self) -> None:
        """Counts a request that ended after its worker left made for it again."""
        registered = {worker.worker_id for worker in self.registry.live()}
        for worker_id in set(self._in_flight) - registered:
            del self._in_flight[worker_id]
        self.ledger.retain(registered)
        self.breakers.retain(registered)

