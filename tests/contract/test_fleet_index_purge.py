"""A worker that restarts (new incarnation id under the same worker id) or goes silent
loses its index entries at once: no request is planned against a cache that is gone."""

from __future__ import annotations

import asyncio

import zmq

from foundation import identity, kv_events, wire
from foundation.netutil import async_context, free_port
from foundation.zmq_auth import secure_client
from orchestrator.fleet import Fleet
from orchestrator.index import PrefixIndex
from orchestrator.index_sync import IndexSync
from orchestrator.registry import WorkerRegistry

FINGERPRINT = "f" * 16
BLOCK = 4
TOKENS = list(range(1, 13))  # three full blocks


def heartbeat(incarnation: str) -> wire.Heartbeat:
    return wire.Heartbeat(worker_id="prefill-0", role="prefill", incarnation=incarnation,
                          rpc_address="tcp://127.0.0.1:1", load=wire.WorkerLoad(block_size=BLOCK),
                          sent_at=0.0, model_fingerprint=FINGERPRINT)


def stored_event() -> kv_events.BlockStored:
    return kv_events.BlockStored(block_hashes=[11, 12, 13], parent_block_hash=None, token_ids=TOKENS,
                                 block_size=BLOCK, extra_keys=[("salt-a",), None, None])


async def send(socket, beat: wire.Heartbeat) -> wire.RegisterReply:
    await socket.send(wire.encode(beat))
    return wire.decode(await asyncio.wait_for(socket.recv(), 5))


async def test_new_incarnation_and_silence_purge_index_entries():
    index = PrefixIndex()
    port = free_port()
    fleet = Fleet(WorkerRegistry(FINGERPRINT, heartbeat_timeout=0.5), f"tcp://127.0.0.1:{port}", "test")
    fleet.listeners.append(IndexSync(index))
    await fleet.start()
    worker = secure_client(async_context().socket(zmq.DEALER), "orchestrator")
    worker.connect(f"tcp://127.0.0.1:{port}")
    prompt_hashes = identity.block_hashes(TOKENS, BLOCK, "salt-a")
    try:
        assert (await send(worker, heartbeat("first"))).accepted
        index.reset_worker("prefill-0", "first")
        index.apply("prefill-0", stored_event())
        assert index.match(prompt_hashes) == {"prefill-0": 3}

        assert (await send(worker, heartbeat("second"))).accepted  # restarted on the same address
        assert index.match(prompt_hashes) == {} and index.num_blocks("prefill-0") == 0

        index.reset_worker("prefill-0", "second")
        index.apply("prefill-0", stored_event())
        await asyncio.sleep(1.5)  # silent past the heartbeat timeout: marked down
        assert fleet.live("prefill") == []
        assert index.match(prompt_hashes) == {}
    finally:
        worker.close(linger=0)
        await fleet.stop()


async def test_refused_worker_is_never_indexed():
    fleet = Fleet(WorkerRegistry(FINGERPRINT, heartbeat_timeout=5), f"tcp://127.0.0.1:{free_port()}", "test")
    await fleet.start()
    worker = secure_client(async_context().socket(zmq.DEALER), "orchestrator")
    worker.connect(fleet._bind_address)
    try:
        beat = heartbeat("x")
        beat.model_fingerprint = "0" * 16
        reply = await send(worker, beat)
        assert not reply.accepted and "does not match" in reply.reason and FINGERPRINT not in reply.reason
        assert fleet.live("prefill") == []
    finally:
        worker.close(linger=0)
        await fleet.stop()


async def test_requests_waiting_on_a_closed_client_fail_at_once():
    from orchestrator.worker_client import WorkerClient, WorkerError

    client = WorkerClient(f"tcp://127.0.0.1:{free_port()}")  # nobody answers there
    request = wire.GenerateRequest(request_id="stranded", prompt_token_ids=[1, 2, 3])

    async def consume():
        return [chunk async for chunk in client.generate(request, timeout=60)]

    pending = asyncio.create_task(consume())
    await asyncio.sleep(0.2)
    await client.close()
    try:
        await asyncio.wait_for(pending, 2)
        raise AssertionError("the stranded request should have failed")
    except WorkerError as error:
        assert error.code == "worker_down"


async def test_admin_view_shows_each_worker_s_measured_prefill_speed():
    from orchestrator.admin import describe_workers

    index = PrefixIndex()
    fleet = Fleet(WorkerRegistry(FINGERPRINT, heartbeat_timeout=5), f"tcp://127.0.0.1:{free_port()}", "test")
    await fleet.start()
    worker = secure_client(async_context().socket(zmq.DEALER), "orchestrator")
    worker.connect(fleet._bind_address)
    try:
        assert (await send(worker, heartbeat("x"))).accepted
        (unmeasured,) = describe_workers(fleet, index)
        assert unmeasured["worker_id"] == "prefill-0" and unmeasured["prefill_speed"] is None
        assert unmeasured["cores"] is None  # its engine is bound to no particular cores
        (measured,) = describe_workers(fleet, index, {"prefill-0": 1.3, "gone": 2.0})
        assert measured["prefill_speed"] == 1.3
    finally:
        worker.close(linger=0)
        await fleet.stop()
