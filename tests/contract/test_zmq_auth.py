"""Every ZeroMQ socket kvroute owns answers only the cluster's keys (foundation.zmq_auth),
over real sockets: the registry, a worker's RPC, its relayed KV events, the transfer
endpoint and transport links. An outsider (in clear, or with a key of its own) gets no
reply and changes nothing; a worker's key may not use another worker's RPC."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import pytest
import zmq

from foundation import cluster_keys, wire, zmq_auth
from foundation.netutil import async_context, free_port, tcp
from foundation.zmq_auth import secure_client, secure_server
from orchestrator.fleet import Fleet
from orchestrator.registry import WorkerRegistry
from testing.synthetic_worker import SyntheticEngine, SyntheticTiming
from tests.contract.transfer_endpoint import Producer
from tests.paged_caches import DTYPES, LAYOUTS
from worker.event_relay import EventRelay
from worker.rpc_server import RpcServer

FINGERPRINT = "f" * 16
SILENCE_MS = 500  # how long an outsider waits for the reply it must never get


def keys() -> cluster_keys.ClusterKeys:
    return cluster_keys.load(os.environ["KVROUTE_CLUSTER_KEYS"])


def outsider(socket: zmq.Socket, how: str, server_role: str) -> zmq.Socket:
    """``in clear``: no CURVE at all; ``stranger``: CURVE with the server's real public key
    but a client key of its own; ``as worker``: a member's worker key."""
    if how == "stranger":
        public, secret = zmq.curve_keypair()
        socket.curve_serverkey = keys().public(server_role)
        socket.curve_publickey, socket.curve_secretkey = public, secret
    elif how == "as worker":
        socket.curve_serverkey = keys().public(server_role)
        socket.curve_publickey, socket.curve_secretkey = keys().public("worker"), keys().secret("worker")
    return socket


async def try_send(socket, message: wire.Message) -> None:
    """Send without waiting: once its handshake has failed, an outsider's socket has no peer
    to queue a message for."""
    try:
        await socket.send(wire.encode(message), flags=zmq.NOBLOCK)
    except zmq.Again:
        pass


def heartbeat(incarnation: str, rpc_address: str = "tcp://127.0.0.1:1") -> wire.Heartbeat:
    return wire.Heartbeat(worker_id="prefill-0", role="prefill", incarnation=incarnation, rpc_address=rpc_address,
                          load=wire.WorkerLoad(block_size=16), sent_at=0.0, model_fingerprint=FINGERPRINT)


@pytest.mark.parametrize("how", ["in clear", "stranger"])
async def test_the_registry_answers_no_outsider_and_its_workers_stay(how, caplog):
    fleet = Fleet(WorkerRegistry(FINGERPRINT, heartbeat_timeout=30), tcp("127.0.0.1", free_port()), "test")
    await fleet.start()
    member = secure_client(async_context().socket(zmq.DEALER), "orchestrator")
    member.connect(fleet._bind_address)
    intruder = outsider(async_context().socket(zmq.DEALER), how, "orchestrator")
    intruder.connect(fleet._bind_address)
    try:
        await member.send(wire.encode(heartbeat("i1")))
        assert wire.decode(await asyncio.wait_for(member.recv(), 5)).accepted
        with caplog.at_level(logging.WARNING, logger="kvroute.auth"):
            # The same worker id, a new incarnation and the intruder's own address: a takeover.
            for _ in range(3):
                await try_send(intruder, heartbeat("evil", rpc_address="tcp://10.66.6.6:6666"))
            assert not await intruder.poll(SILENCE_MS)
        [worker] = fleet.live("prefill")
        assert (worker.worker_id, worker.incarnation, worker.rpc_address) == ("prefill-0", "i1", "tcp://127.0.0.1:1")
        if how == "stranger":  # one warning naming the address, however many tries
            refusals = [r.getMessage() for r in caplog.records if "refused a ZeroMQ peer" in r.getMessage()]
            assert len(refusals) == 1 and "127.0.0.1" in refusals[0]
    finally:
        intruder.close(linger=0)
        member.close(linger=0)
        await fleet.stop()


@pytest.fixture
async def rpc_server():
    async def stats():
        return wire.WorkerStats(worker_id="w", role="decode", incarnation="i", load=wire.WorkerLoad(block_size=16),
                                transfer=wire.TransferCounters(), prompt_tokens=wire.PromptTokenCounters())

    async def unused(*args):
        raise AssertionError("not asked in these tests")

    address = tcp("127.0.0.1", free_port())
    server = RpcServer(SyntheticEngine(SyntheticTiming(token_seconds=0.01), "tcp://127.0.0.1:1"), address,
                       stats, unused, unused, unused)
    serving = asyncio.create_task(server.serve())
    try:
        yield address
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


GENERATE = wire.GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3], sampling=wire.SamplingSpec(max_tokens=2))


@pytest.mark.parametrize("how", ["in clear", "stranger"])
async def test_a_worker_rpc_answers_no_outsider(rpc_server, how):
    intruder = outsider(async_context().socket(zmq.DEALER), how, "worker")
    intruder.connect(rpc_server)
    try:
        await try_send(intruder, GENERATE)
        await try_send(intruder, wire.StatsRequest(request_id="s1"))
        assert not await intruder.poll(SILENCE_MS)
    finally:
        intruder.close(linger=0)


async def test_a_worker_key_may_not_use_a_worker_rpc_but_the_orchestrator_may(rpc_server, caplog):
    peer = outsider(async_context().socket(zmq.DEALER), "as worker", "worker")
    peer.connect(rpc_server)
    orchestrator = secure_client(async_context().socket(zmq.DEALER), "worker")
    orchestrator.connect(rpc_server)
    try:
        for message in (GENERATE, wire.SnapshotRequest(request_id="s1"), wire.ResetCacheRequest(request_id="x")):
            await peer.send(wire.encode(message))
            reply = wire.decode(await asyncio.wait_for(peer.recv(), 5))
            assert isinstance(reply, wire.ErrorReply) and reply.code == "forbidden"
        await orchestrator.send(wire.encode(wire.StatsRequest(request_id="s2")))
        reply = wire.decode(await asyncio.wait_for(orchestrator.recv(), 5))
        assert isinstance(reply, wire.WorkerStats) and reply.request_id == "s2"
        # Three refusals, one line: a member looping on the RPC cannot fill the log.
        refusals = [r for r in caplog.records if "refused an RPC message" in r.getMessage()]
        assert len(refusals) == 1 and "a worker key" in refusals[0].getMessage()
    finally:
        peer.close(linger=0)
        orchestrator.close(linger=0)


def test_kv_events_leave_the_worker_only_to_members():
    public = tcp("127.0.0.1", free_port())
    relay = EventRelay(public).start()
    context = zmq.Context()
    engine = context.socket(zmq.PUB)  # where vLLM's publisher binds
    engine.bind(relay.local_address)
    member = secure_client(context.socket(zmq.SUB), "worker")
    stranger = outsider(context.socket(zmq.SUB), "stranger", "worker")
    clear = context.socket(zmq.SUB)
    for socket in (member, stranger, clear):
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(public)
    try:
        deadline = time.monotonic() + 10
        while not member.poll(50):  # slow joiner: publish until the member hears
            assert time.monotonic() < deadline, "the member never received an event"
            engine.send_multipart([b"kv-events", b"\x00" * 8, b"prompt token ids"])
        assert member.recv_multipart()[-1] == b"prompt token ids"
        engine.send_multipart([b"kv-events", b"\x00" * 8, b"more"])
        assert not stranger.poll(SILENCE_MS // 2) and not clear.poll(SILENCE_MS // 2)
        # The engine's socket, in clear, sits in a folder only this user can open.
        assert os.stat(os.path.dirname(relay.local_address.removeprefix("ipc://"))).st_mode & 0o077 == 0
    finally:
        context.destroy(linger=0)
        relay.stop()


@pytest.mark.parametrize("how", ["in clear", "stranger"])
def test_the_transfer_endpoint_answers_no_outsider(how):
    producer = Producer(DTYPES["float32"], next(iter(LAYOUTS)))
    context = zmq.Context()
    intruder = outsider(context.socket(zmq.DEALER), how, "worker")
    intruder.connect(producer.address)
    try:
        with producer.serving():
            producer.lease([1, 2])
            # Without waiting, as try_send: a blocking send hangs once the handshake has failed.
            with contextlib.suppress(zmq.Again):
                intruder.send(wire.encode(wire.ReleaseAllLeases(reason="attack")), zmq.NOBLOCK)
            assert not intruder.poll(SILENCE_MS)
            assert len(producer.leases) == 1  # nothing released
    finally:
        context.destroy(linger=0)


def test_a_link_host_sends_nothing_to_an_outsider():
    context = zmq.Context()
    host = secure_server(context.socket(zmq.PUSH), "worker", transfer=True)
    port = host.bind_to_random_port("tcp://127.0.0.1")
    clear = context.socket(zmq.PULL)
    clear.connect(f"tcp://127.0.0.1:{port}")
    member = secure_client(context.socket(zmq.PULL), "worker", transfer=True)
    member.connect(f"tcp://127.0.0.1:{port}")
    try:
        host.send(b"kv bytes", flags=0)
        assert member.poll(5000) and member.recv() == b"kv bytes"
        host.send(b"more kv bytes")
        assert member.poll(5000) and member.recv() == b"more kv bytes"
        assert not clear.poll(SILENCE_MS // 2)  # PUSH round-robins only over peers that authenticated
    finally:
        context.destroy(linger=0)


def test_transfer_encryption_off_leaves_the_control_plane_under_keys():
    before = zmq_auth.current()
    try:
        zmq_auth.configure(before.keys, before.identity, transfer_encryption=False)
        context = zmq.Context()
        transfer = secure_server(context.socket(zmq.ROUTER), "worker", transfer=True)
        control = secure_server(context.socket(zmq.ROUTER), "worker")
        assert not transfer.curve_server and control.curve_server
        context.destroy(linger=0)
    finally:
        zmq_auth.configure(before.keys, before.identity, before.transfer_encryption)
