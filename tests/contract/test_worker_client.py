"""The orchestrator's worker client over real sockets, against a ROUTER socket playing the
worker: it waits on while its patience handler says so, and asks again after a stats
request went unanswered."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from foundation import wire
from foundation.zmq_auth import secure_server
from orchestrator.retry import RetryPolicy
from orchestrator.worker_client import WorkerClient, WorkerTimeout


async def test_the_worker_client_waits_on_while_the_handler_says_so():
    """Over real sockets: a worker that answers after 0.5 s, waits of 0.15 s. Without a
    handler the first timeout ends the request; with one that returns, the chunk arrives."""
    context = zmq.asyncio.Context()
    worker = secure_server(context.socket(zmq.ROUTER), "worker")
    port = worker.bind_to_random_port("tcp://127.0.0.1")
    client = WorkerClient(f"tcp://127.0.0.1:{port}", context)

    async def answer(identity: bytes, request_id: str):
        await asyncio.sleep(0.5)
        chunk = wire.GenerateChunk(request_id=request_id, token_ids=[7], finished=True)
        await worker.send_multipart([identity, wire.encode(chunk)])

    async def answer_late():
        answers = set()
        while True:
            identity, frame = await worker.recv_multipart()
            request = wire.decode(frame)
            if isinstance(request, wire.GenerateRequest):
                answers.add(asyncio.create_task(answer(identity, request.request_id)))

    server = asyncio.create_task(answer_late())
    timeouts: list[WorkerTimeout] = []
    try:
        with pytest.raises(WorkerTimeout):
            [c async for c in client.generate(wire.GenerateRequest(request_id="impatient", prompt_token_ids=[1]),
                                              timeout=0.15)]
        chunks = [c async for c in client.generate(wire.GenerateRequest(request_id="patient", prompt_token_ids=[1]),
                                                   timeout=0.15, on_timeout=timeouts.append)]
        assert [c.token_ids for c in chunks] == [[7]]
        assert len(timeouts) >= 2 and all("patient" in str(t) for t in timeouts)
    finally:
        server.cancel()
        await client.close()
        worker.close(linger=0)
        context.term()


async def test_the_worker_client_asks_again_after_an_unanswered_stats_request():
    """Over real sockets: a worker that drops the first request answers the second."""
    context = zmq.asyncio.Context()
    worker = secure_server(context.socket(zmq.ROUTER), "worker")
    port = worker.bind_to_random_port("tcp://127.0.0.1")
    client = WorkerClient(f"tcp://127.0.0.1:{port}", context,
                          RetryPolicy(attempts=2, base_delay_seconds=0.01))
    seen = []

    async def serve_second():
        while True:
            identity, frame = await worker.recv_multipart()
            request = wire.decode(frame)
            seen.append(request.request_id)
            if len(seen) == 2:
                reply = wire.WorkerStats(worker_id="w", role="decode", incarnation="i", load=wire.WorkerLoad(),
                                         transfer=wire.TransferCounters(), prompt_tokens=wire.PromptTokenCounters(),
                                         request_id=request.request_id)
                await worker.send_multipart([identity, wire.encode(reply)])

    server = asyncio.create_task(serve_second())
    try:
        stats = await client.stats(timeout=0.3)
        assert stats.worker_id == "w" and len(set(seen)) == 2  # each attempt has its own request id
    finally:
        server.cancel()
        await client.close()
        worker.close(linger=0)
        context.term()
