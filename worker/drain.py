"""How a worker stops: SIGTERM drains it; a second signal, or the drain deadline, stops it.

::

    SERVING ──SIGTERM──▶ DRAINING ──nothing running, no lease held──▶ STOPPED
       │                    ├── SIGTERM or SIGINT ────────────────────▶ STOPPED
       │                    └── drain_seconds passed: leases released ▶ STOPPED
       └── SIGINT (Ctrl-C) ───────────────────────────────────────────▶ STOPPED

Draining, the RPC server refuses new generates with code ``draining`` and a heartbeat
sent at once says so: orchestrators plan nothing new onto the worker, and place a
request that raced onto it elsewhere. Requests already running end as they would
have. A prefill worker also waits for the leases it handed out, because each is a
decode worker's next pull, which would turn into a recompute if the blocks went away.
With nothing running and nothing held, the worker stops at once. STOPPED cancels the
serving tasks; stopping the rest (the engine) is the caller's.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.heartbeat import HeartbeatSender
    from worker.rpc_server import RpcServer

logger = logging.getLogger("kvroute.worker.drain")

LEASE_POLL_SECONDS = 0.1


class StopSignals:
    """What the process was told; set only by the event loop's signal handlers."""

    def __init__(self):
        self.drain = asyncio.Event()  # SIGTERM: finish what runs, then stop
        self.stop = asyncio.Event()  # SIGINT, or SIGTERM while draining: stop now
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._terminate)
        loop.add_signal_handler(signal.SIGINT, self.stop.set)

    def _terminate(self) -> None:
        (self.stop if self.drain.is_set() else self.drain).set()


async def _no_lease_held() -> bool:
    return True


async def _no_lease_released() -> int:
    return 0


@dataclass
class Drain:
    """Takes a serving worker through DRAINING. ``leases_settled``: whether every lease the
    worker handed out has ended; ``release_leases``: end those left at the deadline. A
    worker that grants no leases (a decode worker, the synthetic one) keeps the defaults."""

    server: RpcServer
    heartbeats: HeartbeatSender
    seconds: float
    leases_settled: Callable[[], Awaitable[bool]] = _no_lease_held
    release_leases: Callable[[], Awaitable[int]] = _no_lease_released

    async def run(self, stop: asyncio.Event, serving: list[asyncio.Task]) -> None:
        """Until nothing runs and no lease is held, ``stop`` is set, or the deadline passed."""
        self.server.start_draining()
        self.heartbeats.send_now()
        logger.info("draining: refusing new requests; stopping once %d running end, within %g s",
                    self.server.num_active_requests, self.seconds)
        settled = asyncio.ensure_future(self._settled())
        if await first_of([settled, stop.wait()], serving, timeout=self.seconds) is settled:
            logger.info("drained: nothing running, no lease held")
            return
        reason = "told again to stop" if stop.is_set() else f"drain_seconds ({self.seconds:g}) passed"
        running = self.server.num_active_requests
        try:
            released = await self.release_leases()
        except Exception as error:  # stopping regardless: the engine's shutdown frees them too
            logger.warning("could not release leases: %s", error)
            released = 0
        logger.warning("stopping (%s) with %d requests running; %d leases released", reason, running, released)

    async def _settled(self) -> None:
        await self.server.wait_idle()  # final: nothing new starts while draining
        while not await self.leases_settled():
            await asyncio.sleep(LEASE_POLL_SECONDS)


async def serve_until_stopped(serving: list[asyncio.Task], signals: StopSignals, drain: Drain) -> None:
    """Run until STOPPED (see the module docstring), then cancel and await ``serving``.
    Raises if a serving task ended on its own: a worker that cannot serve stops."""
    try:
        await first_of([signals.drain.wait(), signals.stop.wait()], serving)
        if not signals.stop.is_set():
            await drain.run(signals.stop, serving)
    finally:
        for task in serving:
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)


async def first_of(awaitables: list[Awaitable], watched: list[asyncio.Task],
                   timeout: float | None = None) -> asyncio.Future | None:
    """The first of ``awaitables`` to finish (as a future), or None when ``timeout`` passed
    first; the others are cancelled. Raises if one of the ``watched`` tasks ended first."""
    waiters = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        done, _ = await asyncio.wait([*waiters, *watched], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    for task in watched:
        if task in done:
            raise RuntimeError(f"worker task {task.get_coro().__name__} ended unexpectedly") from task.exception()
    return next((waiter for waiter in waiters if waiter in done), None)
