"""Registration and heartbeats: the worker's identity and load, pushed to every orchestrator.

Each orchestrator replica gets its own DEALER connection, so replicas need no shared
store. The first reply (and every change of verdict) is logged: a refusal names its
reason, e.g. a model fingerprint that differs from the orchestrator's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq

from kvroute import wire
from kvroute.netutil import async_context

logger = logging.getLogger("kvroute.worker.heartbeat")


def heartbeat_of(settings, load: wire.WorkerLoad, model_fingerprint: str, now: float) -> wire.Heartbeat:
    """A worker's heartbeat: its identity and addresses from ``settings``, and its load."""
    return wire.Heartbeat(worker_id=settings.worker_id, role=settings.role, incarnation=settings.incarnation,
                          rpc_address=settings.rpc_address, load=load, sent_at=now,
                          kv_events_address=settings.kv_events_address, model_fingerprint=model_fingerprint)


class HeartbeatSender:
    """One socket per orchestrator; owned by the task running ``run``."""

    def __init__(self, orchestrators: tuple[str, ...], make: Callable[[float], wire.Heartbeat]):
        self._make = make
        self._sockets = {}
        self._verdicts: dict[str, bool | None] = {}
        for address in orchestrators:
            socket = async_context().socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            self._sockets[address] = socket
            self._verdicts[address] = None

    async def run(self, interval_seconds: float) -> None:
        try:
            while True:
                payload = wire.encode(self._make(time.time()))
                for address, socket in self._sockets.items():
                    await socket.send(payload)
                    await self._read_replies(address, socket)
                await asyncio.sleep(interval_seconds)
        finally:
            for socket in self._sockets.values():
                socket.close(linger=0)

    async def _read_replies(self, address: str, socket) -> None:
        while await socket.poll(0):
            try:
                reply = wire.decode(await socket.recv())
            except wire.WireError:
                continue
            if isinstance(reply, wire.RegisterReply):
                self._note(address, reply)

    def _note(self, address: str, reply: wire.RegisterReply) -> None:
        if self._verdicts[address] == reply.accepted:
            return
        self._verdicts[address] = reply.accepted
        if reply.accepted:
            logger.info("registered with orchestrator %s", address)
        else:
            logger.error("orchestrator %s refused this worker: %s", address, reply.reason)
