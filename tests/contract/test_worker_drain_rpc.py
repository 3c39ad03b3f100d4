"""Graceful drain over real sockets: the heartbeat that says "draining" at once, the fleet that
then plans around the worker, and the real RPC server over the synthetic engine in this
process (it refuses new requests, finishes the running one, and stops at the deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import pytest
import zmq

from foundation import wire
from foundation.netutil import async_context, free_port
from foundation.zmq_auth import secure_client, secure_server
from orchestrator.admin import describe_workers
from orchestrator.fleet import Fleet
from orchestrator.index import PrefixIndex
from orchestrator.metrics import Metrics
from orchestrator.registry import WorkerRegistry
from orchestrator.worker_client import WorkerClient, WorkerError
from testing.synthetic_worker import SyntheticEngine, SyntheticTiming, synthetic_next_token
from tests.drain_fakes import FakeHeartbeats
from worker.drain import Drain, serve_until_stopped
from worker.heartbeat import HeartbeatSender
from worker.rpc_server import DRAINING, RpcServer

# ---------------------------------------------------------------- heartbeat and fleet

FINGERPRINT = "f" * 16


def heartbeat(worker_id: str, draining: bool) -> wire.Heartbeat:
    return wire.Heartbeat(worker_id=worker_id, role="decode", incarnation="i1", rpc_address="tcp://127.0.0.1:1",
                          load=wire.WorkerLoad(block_size=16), sent_at=0.0, model_fingerprint=FINGERPRINT,
                          draining=draining)


async def test_send_now_beats_before_the_interval_is_up():
    orchestrator = secure_server(async_context().socket(zmq.ROUTER), "orchestrator")
    address = f"tcp://127.0.0.1:{free_port()}"
    orchestrator.bind(address)
    draining = False
    sender = HeartbeatSender((address,), lambda now: heartbeat("decode-0", draining))
    beating = asyncio.create_task(sender.run(interval_seconds=3600))
    try:
        _, first = await asyncio.wait_for(orchestrator.recv_multipart(), 5)
        assert not wire.decode(first).draining
        draining = True
        sender.send_now()
        _, second = await asyncio.wait_for(orchestrator.recv_multipart(), 1)
        assert wire.decode(second).draining
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        orchestrator.close(linger=0)


async def test_a_draining_worker_leaves_planning_but_stays_visible():
    fleet = Fleet(WorkerRegistry(FINGERPRINT, heartbeat_timeout=30), f"tcp://127.0.0.1:{free_port()}", "test")
    await fleet.start()
    worker = secure_client(async_context().socket(zmq.DEALER), "orchestrator")
    worker.connect(fleet._bind_address)

    async def beat(draining: bool) -> None:
        await worker.send(wire.encode(heartbeat("decode-0", draining)))
        assert wire.decode(await asyncio.wait_for(worker.recv(), 5)).accepted

    try:
        await beat(draining=False)
        assert [w.worker_id for w in fleet.live("decode")] == ["decode-0"] and fleet.draining("decode") == []
        await beat(draining=True)
        assert fleet.live("decode") == [] and not fleet.can_serve()
        assert [w.worker_id for w in fleet.draining("decode")] == ["decode-0"]
        assert [(row["worker_id"], row["draining"]) for row in describe_workers(fleet, PrefixIndex())] \
            == [("decode-0", True)]
        metrics = Metrics()
        metrics.refresh_fleet(fleet, PrefixIndex())
        assert metrics.registry.get_sample_value("kvroute_workers_draining", {"role": "decode"}) == 1
        assert metrics.registry.get_sample_value("kvroute_workers", {"role": "decode"}) == 0
    finally:
        worker.close(linger=0)
        await fleet.stop()


# ---------------------------------------------------------------- the RPC server, in this process

PROMPT = [11, 12, 13, 14, 15]


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens an unbroken synthetic run generates (see ``synthetic_next_token``)."""
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(synthetic_next_token(context))
    return context[len(prompt):]


def generate(request_id: str, max_tokens: int) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                sampling=wire.SamplingSpec(max_tokens=max_tokens))


@contextlib.asynccontextmanager
async def serving_synthetic(priority_of=None):
    """A real RPC server over the synthetic engine, its serving task, and a client of it."""

    async def unused(*args):
        raise AssertionError("not asked in these tests")

    address = f"tcp://127.0.0.1:{free_port()}"
    server = RpcServer(SyntheticEngine(SyntheticTiming(token_seconds=0.02), "tcp://127.0.0.1:1"), address,
                       unused, unused, unused, unused, priority_of=priority_of)
    serving = asyncio.create_task(server.serve())
    client = WorkerClient(address)
    try:
        yield server, serving, client
    finally:
        await client.close()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


@pytest.fixture
async def synthetic_server():
    async with serving_synthetic() as served:
        yield served


async def test_each_request_reaches_the_engine_with_the_priority_the_worker_gives_it():
    async with serving_synthetic(lambda prompt: 7 * len(prompt.request.prompt_token_ids)) as (server, _, client):
        assert len([c async for c in client.generate(generate("ranked", 2), timeout=5)]) >= 1
        assert server.engine.priorities == {"ranked": 7 * len(PROMPT)}
    async with serving_synthetic() as (server, _, client):  # vLLM's own order: every priority 0
        [_ async for _ in client.generate(generate("unranked", 2), timeout=5)]
        assert server.engine.priorities == {"unranked": 0}


async def test_a_draining_server_refuses_new_requests_and_finishes_the_running_one(synthetic_server):
    server, _, client = synthetic_server
    tokens = []
    async for chunk in client.generate(generate("long", 30), timeout=5):
        tokens += chunk.token_ids
        if len(tokens) == 5:
            server.start_draining()
            with pytest.raises(WorkerError) as refused:
                [_ async for _ in client.generate(generate("late", 4), timeout=5)]
            assert refused.value.code == DRAINING
    assert tokens == reference(PROMPT, 30)
    await asyncio.wait_for(server.wait_idle(), 1)
    assert server.num_active_requests == 0


async def test_at_the_drain_deadline_the_server_stops_and_its_caller_hears_at_once(synthetic_server):
    server, serving, client = synthetic_server
    signals = SimpleNamespace(drain=asyncio.Event(), stop=asyncio.Event())
    stopping = asyncio.create_task(serve_until_stopped([serving], signals, Drain(server, FakeHeartbeats(), 0.3)))
    tokens, started = [], None
    with pytest.raises(WorkerError) as cut:
        async for chunk in client.generate(generate("long", 200), timeout=5):  # 4 s of tokens
            tokens += chunk.token_ids
            if len(tokens) == 3:
                signals.drain.set()
                started = time.monotonic()
    await asyncio.wait_for(stopping, 1)
    assert time.monotonic() - started < 1.5
    assert cut.value.code == "worker_disconnected"  # the orchestrator moves such a request elsewhere
    assert 3 <= len(tokens) < 200
