"""The measurement HTTP client against a real uvicorn server: JSON bodies, SSE over
chunked encoding, keep-alive reuse, and a stream left early not poisoning the next request."""

from __future__ import annotations

import asyncio
import json

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from foundation.netutil import free_port
from kvroute.bench.lean_http import LeanConnection, LeanHTTPError


def app() -> FastAPI:
    api = FastAPI()
    connections: set = set()

    @api.post("/echo")
    async def echo(request: Request):
        connections.add(request.client.port)
        body = await request.json()
        status = body.get("status", 200)
        return JSONResponse({"got": body, "connections": len(connections)}, status_code=status)

    @api.post("/events")
    async def events(request: Request):
        body = await request.json()
        if "status" in body:
            return JSONResponse({"error": "refused"}, status_code=body["status"])

        async def stream():
            for i in range(body["n"]):
                yield f"data: {json.dumps({'i': i, 'pad': 'x' * body.get('pad', 0)})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    return api


@pytest.fixture
async def server():
    port = free_port()
    instance = uvicorn.Server(uvicorn.Config(app(), host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(instance.serve())
    while not instance.started:
        await asyncio.sleep(0.01)
    yield port
    instance.should_exit = True
    await task


async def test_json_round_trips_on_one_kept_alive_connection(server):
    connection = LeanConnection("127.0.0.1", server)
    try:
        for i in range(3):
            status, body = await connection.post_json("/echo", {"i": i})
            assert status == 200 and body["got"] == {"i": i}
        assert body["connections"] == 1
        status, body = await connection.post_json("/echo", {"status": 429})
        assert status == 429 and body["got"]["status"] == 429
    finally:
        await connection.close()


async def test_events_arrive_whole_across_chunk_boundaries(server):
    connection = LeanConnection("127.0.0.1", server)
    try:
        events = [e async for e in connection.post_sse("/events", {"n": 5, "pad": 70_000})]
        assert events[-1] == "[DONE]"
        assert [json.loads(e)["i"] for e in events[:-1]] == list(range(5))
        assert all(len(json.loads(e)["pad"]) == 70_000 for e in events[:-1])
    finally:
        await connection.close()


async def test_a_stream_left_early_does_not_poison_the_next_request(server):
    connection = LeanConnection("127.0.0.1", server)
    try:
        async for _ in connection.post_sse("/events", {"n": 50}):
            break
        status, body = await connection.post_json("/echo", {"after": True})
        assert status == 200 and body["got"] == {"after": True}
    finally:
        await connection.close()


async def test_an_error_status_on_a_stream_raises(server):
    connection = LeanConnection("127.0.0.1", server)
    try:
        with pytest.raises(LeanHTTPError, match="HTTP 422"):
            async for _ in connection.post_sse("/events", {"status": 422}):
                pass
    finally:
        await connection.close()
