"""The registry's receive loop against what any process that reaches its port can send: a
frame over the size bound, a flood of ids, a listener that fails while a worker registers.
None ends the loop, and state keyed by peer-chosen ids stays bounded."""

from __future__ import annotations

import asyncio
import secrets

import zmq

from foundation import wire
from foundation.netutil import async_context, free_port
from foundation.zmq_auth import secure_client
from orchestrator.fleet import REMEMBERED_REFUSALS, Fleet
from orchestrator.registry import WorkerRegistry

FINGERPRINT = "f" * 16


def heartbeat(worker_id: str, fingerprint: str = FINGERPRINT) -> wire.Heartbeat:
    return wire.Heartbeat(worker_id=worker_id, role="decode", incarnation="i1", rpc_address="tcp://127.0.0.1:1",
                          load=wire.WorkerLoad(block_size=16), sent_at=0.0, model_fingerprint=fingerprint)


class Peer:
    def __init__(self, address: str):
        self.socket = secure_client(async_context().socket(zmq.DEALER), "orchestrator")
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    async def register(self, beat: wire.Heartbeat) -> wire.RegisterReply:
        await self.socket.send(wire.encode(beat))
        return wire.decode(await asyncio.wait_for(self.socket.recv(), 10))

    def close(self) -> None:
        self.socket.close(linger=0)


async def started_fleet(max_frame_bytes: int = 1 << 20) -> Fleet:
    fleet = Fleet(WorkerRegistry(FINGERPRINT, heartbeat_timeout=30), f"tcp://127.0.0.1:{free_port()}", "test",
                  max_frame_bytes=max_frame_bytes)
    await fleet.start()
    return fleet


async def test_a_flood_of_refused_ids_is_remembered_only_up_to_the_bound():
    fleet = await started_fleet()
    flooder, worker = Peer(fleet._bind_address), Peer(fleet._bind_address)
    try:
        for _ in range(3 * REMEMBERED_REFUSALS):
            await flooder.socket.send(wire.encode(heartbeat(secrets.token_hex(8), fingerprint="0" * 16)))
        while len(fleet.refused) < REMEMBERED_REFUSALS:  # the flood is being read
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert (await worker.register(heartbeat("decode-0"))).accepted
        assert len(fleet.refused) == REMEMBERED_REFUSALS
        assert [w.worker_id for w in fleet.registry.live()] == ["decode-0"]
    finally:
        flooder.close()
        worker.close()
        await fleet.stop()


async def test_an_oversized_frame_is_dropped_unread_and_the_registry_keeps_answering():
    fleet = await started_fleet(max_frame_bytes=4096)
    flooder, worker = Peer(fleet._bind_address), Peer(fleet._bind_address)
    try:
        await flooder.socket.send(b"\x81" + b"x" * 8192)
        assert not await flooder.socket.poll(300)  # no answer: libzmq closed that connection
        assert (await worker.register(heartbeat("decode-0"))).accepted
    finally:
        flooder.close()
        worker.close()
        await fleet.stop()


class FailsOnce:
    """A listener that raises the first time a worker comes up."""

    def __init__(self):
        self.failed, self.up = False, []

    def worker_up(self, view, client) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("listener failed")
        self.up.append(view.worker_id)

    def worker_down(self, worker_id: str) -> None:
        pass

    def worker_left(self, worker_id: str) -> None:
        pass


async def test_a_registration_that_fails_halfway_is_undone_and_the_next_beat_registers_afresh():
    fleet = await started_fleet()
    listener = FailsOnce()
    fleet.listeners.append(listener)
    peer = Peer(fleet._bind_address)
    try:
        await peer.socket.send(wire.encode(heartbeat("decode-0")))
        assert not await peer.socket.poll(300)  # dropped: no reply, and nothing kept of it
        assert fleet.registry.get("decode-0") is None and fleet.client("decode-0") is None
        assert (await peer.register(heartbeat("decode-0"))).accepted
        assert listener.up == ["decode-0"] and fleet.client("decode-0") is not None
    finally:
        peer.close()
        await fleet.stop()


async def test_what_a_late_request_records_for_a_departed_worker_is_swept():
    fleet = Fleet(WorkerRegistry(FINGERPRINT, heartbeat_timeout=0.3), f"tcp://127.0.0.1:{free_port()}", "test")
    await fleet.start()
    worker = Peer(fleet._bind_address)
    try:
        assert (await worker.register(heartbeat("decode-0"))).accepted
        while fleet.registry.get("decode-0") is not None:  # silent: marked down
            await asyncio.sleep(0.05)
        fleet.breakers.failed("decode-0", 0.0)  # a request that ended after the worker left
        fleet.ledger.reserved("decode-0", "request-1", 4)
        fleet.track("decode-0", +1)
        await asyncio.sleep(0.5)  # an expiry round or two
        assert fleet.breakers.states(0.0) == {} and fleet.in_flight("decode-0") == 0
        assert fleet.ledger.heartbeat_is_current("decode-0") and fleet.ledger.free_blocks("decode-0", 7, 10) == 7
    finally:
        worker.close()
        await fleet.stop()
