"""HeartbeatSender against orchestrators that go away: a dead replica holds back no other
replica's beats, and a restarted orchestrator gets the worker's current beats, not a
backlog, and the worker logs that it registered again."""

from __future__ import annotations

import asyncio
import logging
import time

import zmq

from foundation import wire
from foundation.netutil import async_context, free_port, tcp
from foundation.zmq_auth import secure_server
from worker.heartbeat import BEATS_QUEUED, HeartbeatSender


def beat(now: float) -> wire.Heartbeat:
    return wire.Heartbeat(worker_id="prefill-0", role="prefill", incarnation="i1", rpc_address="tcp://127.0.0.1:1",
                          load=wire.WorkerLoad(block_size=16), sent_at=now)


class FakeOrchestrator:
    """A registry endpoint that accepts every beat and remembers when each was sent."""

    def __init__(self, address: str, orchestrator_id: str):
        self.orchestrator_id = orchestrator_id
        self.socket = secure_server(async_context().socket(zmq.ROUTER), "orchestrator")
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.sent_at: list[float] = []

    async def receive(self, seconds: float) -> None:
        """Answer beats for ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if await self.socket.poll(left * 1000):
                identity, frame = await self.socket.recv_multipart()
                self.sent_at.append(wire.decode(frame).sent_at)
                reply = wire.RegisterReply(accepted=True, orchestrator_id=self.orchestrator_id)
                await self.socket.send_multipart([identity, wire.encode(reply)])

    def close(self) -> None:
        self.socket.close(linger=0)


async def stopped(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_dead_orchestrator_does_not_hold_back_the_beats_to_the_others():
    dead, live = tcp("127.0.0.1", free_port()), tcp("127.0.0.1", free_port())
    orchestrator = FakeOrchestrator(live, "live")
    sender = asyncio.create_task(HeartbeatSender((dead, live), beat).run(interval_seconds=0))
    try:
        # Far more beats than ZeroMQ's default queue of 1000 for the replica nobody answers.
        deadline = time.monotonic() + 60
        while len(orchestrator.sent_at) < 3000:
            assert time.monotonic() < deadline, f"beats to the live replica stopped at {len(orchestrator.sent_at)}"
            await orchestrator.receive(0.2)
    finally:
        await stopped(sender)
        orchestrator.close()


async def test_a_restarted_orchestrator_gets_current_beats_and_the_worker_registers_again(caplog):
    caplog.set_level(logging.INFO, logger="kvroute.worker.heartbeat")
    address = tcp("127.0.0.1", free_port())
    first = FakeOrchestrator(address, "orchestrator-1")
    sender = asyncio.create_task(HeartbeatSender((address,), beat).run(interval_seconds=0.005))
    try:
        await first.receive(0.5)
        assert first.sent_at, "no beat reached the orchestrator"
        first.close()
        await asyncio.sleep(1.0)  # ~200 beats while it is down
        restarted_at = time.time()
        second = FakeOrchestrator(address, "orchestrator-2")
        await second.receive(1.0)
        second.close()
    finally:
        await stopped(sender)
    stale = [sent for sent in second.sent_at if sent < restarted_at]
    assert len(stale) <= 2 * BEATS_QUEUED, f"{len(stale)} beats from the downtime were delivered"
    assert len(second.sent_at) - len(stale) > 50, "current beats did not reach the restarted orchestrator"
    registrations = [r.getMessage() for r in caplog.records if r.getMessage().startswith("registered with")]
    assert [m.split("(")[-1] for m in registrations] == ["orchestrator-1)", "orchestrator-2)"], registrations
    assert any("takes no heartbeats" in r.getMessage() for r in caplog.records)


async def test_a_dns_name_reaches_every_replica_it_resolves_to_and_follows_its_changes():
    """Two registries on one port of two loopback addresses, named by one DNS name (a headless
    Service's records): both get beats; once the name loses one address, its socket closes
    and only the other gets beats; the status callback sees what each replica said."""
    port = free_port()
    first = FakeOrchestrator(tcp("127.0.0.1", port), "first")
    second = FakeOrchestrator(tcp("127.0.0.2", port), "second")
    records = {"registry.test": ["127.0.0.1", "127.0.0.2"]}
    rounds: list[dict] = []

    async def lookup(name: str, port: int) -> list[str]:
        return records[name]

    sender = HeartbeatSender((f"dns://registry.test:{port}",), beat, resolve_seconds=0.2,
                             after_round=lambda registrations: rounds.append(
                                 {address: r.accepted for address, r in registrations.items()}),
                             lookup=lookup)
    task = asyncio.create_task(sender.run(interval_seconds=0.01))
    try:
        await asyncio.gather(first.receive(0.5), second.receive(0.5))
        assert first.sent_at and second.sent_at
        assert rounds[-1] == {tcp("127.0.0.1", port): True, tcp("127.0.0.2", port): True}
        records["registry.test"] = ["127.0.0.2"]
        changed_at = time.time()
        await asyncio.gather(first.receive(2.0), second.receive(2.0))  # the name is looked up again within 0.2 s
        assert max(first.sent_at) < changed_at + 1.0, "beats still went to the replica the name no longer has"
        assert sum(sent > changed_at + 1.0 for sent in second.sent_at) > 10
        assert rounds[-1] == {tcp("127.0.0.2", port): True}
    finally:
        await stopped(task)
        first.close()
        second.close()
