"""Registration and heartbeats: the worker's identity and load, pushed to every orchestrator.

Each orchestrator replica gets its own DEALER connection, so replicas need no shared
store. Which replicas there are comes from ``worker.orchestrator_targets``: fixed
addresses, or a DNS name looked up again, so a replica that appears gets a connection at
the next beat and one whose address is gone loses it. The first reply (and every change of
verdict, or of the orchestrator answering, as after its restart) is logged: a refusal names
its reason, e.g. a model fingerprint that differs from the orchestrator's. A beat for an
orchestrator that is down is dropped, never queued: a waiting send would hold back the
beats to every other replica, and a restarted orchestrator needs the worker's current load,
not a backlog of old ones. After every round, ``after_round`` gets what each orchestrator
last said (the worker's status file, ``worker.status_file``, is written from it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from foundation import wire
from foundation.netutil import async_context
from foundation.zmq_auth import secure_client
from worker.orchestrator_targets import DEFAULT_RESOLVE_SECONDS, Lookup, OrchestratorTargets, system_lookup

logger = logging.getLogger("kvroute.worker.heartbeat")
BEATS_QUEUED = 4  # per orchestrator, while it is not connected; later beats are dropped
MAX_REPLY_BYTES = 64 * 1024  # a RegisterReply is a few hundred bytes; libzmq drops a peer sending more


def heartbeat_of(settings, load: wire.WorkerLoad, model_fingerprint: str, now: float,
                 draining: bool = False, prefill_probe: wire.PrefillProbe | None = None,
                 cores: wire.CoreBinding | None = None) -> wire.Heartbeat:
    """A worker's heartbeat: its identity and addresses from ``settings``, its load,
    whether it is draining (then orchestrators plan nothing new onto it), its start-up
    prefill timing and the cores its engine computes on."""
    return wire.Heartbeat(worker_id=settings.worker_id, role=settings.role, incarnation=settings.incarnation,
                          rpc_address=settings.rpc_address, load=load, sent_at=now,
                          kv_events_address=settings.kv_events_address, model_fingerprint=model_fingerprint,
                          transfer_address=settings.transfer_address, draining=draining,
                          prefill_probe=prefill_probe, cores=cores,
                          node_store_address=settings.node_store)


@dataclass
class Registration:
    """What one orchestrator last said about this worker."""

    accepted: bool | None = None  # None: no answer yet, or none since it became unreachable
    orchestrator_id: str = ""
    reason: str = ""  # why it refused
    last_accepted_at: float = 0.0  # wall-clock time of its last accepting reply; 0: none yet
    unreachable: bool = False  # its send queue is full: down, or not reached


class HeartbeatSender:
    """One socket per orchestrator; sockets and registrations owned by the task running ``run``."""

    def __init__(self, orchestrators: tuple[str, ...], make: Callable[[float], wire.Heartbeat],
                 resolve_seconds: float = DEFAULT_RESOLVE_SECONDS,
                 after_round: Callable[[dict[str, Registration]], None] | None = None,
                 lookup: Lookup = system_lookup):
        self._make = make
        self._after_round = after_round
        self._targets = OrchestratorTargets(orchestrators, resolve_seconds, lookup)
        self._due = asyncio.Event()  # set by ``send_now``: beat before the interval is up
        self._sockets: dict[str, zmq.Socket] = {}
        self.registrations: dict[str, Registration] = {}

    async def run(self, interval_seconds: float) -> None:
        try:
            while True:
                self._connect(await self._targets.current(time.monotonic()))
                payload = wire.encode(self._make(time.time()))
                for address, socket in self._sockets.items():
                    await self._send(address, socket, payload)
                    await self._read_replies(address, socket)
                if self._after_round is not None:
                    self._after_round(self.registrations)
                await self._pause(interval_seconds)
        finally:
            for socket in self._sockets.values():
                socket.close(linger=0)

    def send_now(self) -> None:
        """Beat at once, e.g. to say the worker is draining before more requests reach it."""
        self._due.set()

    def _connect(self, addresses: tuple[str, ...]) -> None:
        """A socket for every address in ``addresses``, none for any other."""
        for address in [a for a in self._sockets if a not in addresses]:
            self._sockets.pop(address).close(linger=0)
            del self.registrations[address]
            logger.info("orchestrator %s is no longer listed; stopped beating to it", address)
        for address in addresses:
            if address not in self._sockets:
                socket = secure_client(async_context().socket(zmq.DEALER), "orchestrator")
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.SNDHWM, BEATS_QUEUED)
                socket.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
                socket.connect(address)
                self._sockets[address] = socket
                self.registrations[address] = Registration()

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._due.wait()
        self._due.clear()

    async def _send(self, address: str, socket, payload: bytes) -> None:
        try:
            await socket.send(payload, flags=zmq.NOBLOCK)
        except zmq.Again:
            registration = self.registrations[address]
            if not registration.unreachable:
                registration.unreachable = True
                registration.accepted = None  # log the registration again once it answers
                logger.warning("orchestrator %s takes no heartbeats (down or unreachable); dropping them "
                               "until it does", address)

    async def _read_replies(self, address: str, socket) -> None:
        while await socket.poll(0):
            try:
                reply = wire.decode(await socket.recv())
            except wire.WireError:
                continue
            if isinstance(reply, wire.RegisterReply):
                self._note(self.registrations[address], address, reply)

    @staticmethod
    def _note(registration: Registration, address: str, reply: wire.RegisterReply) -> None:
        registration.unreachable = False
        if reply.accepted:
            registration.last_accepted_at = time.time()
        if registration.accepted == reply.accepted and registration.orchestrator_id == reply.orchestrator_id:
            return
        registration.accepted = reply.accepted
        registration.orchestrator_id = reply.orchestrator_id
        registration.reason = reply.reason
        if reply.accepted:
            logger.info("registered with orchestrator %s (%s)", address, reply.orchestrator_id or "id unknown")
        else:
            logger.error("orchestrator %s refused this worker: %s", address, reply.reason)
