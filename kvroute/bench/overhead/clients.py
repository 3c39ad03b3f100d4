"""The two ways ``kvroute bench orchestrator`` runs the same request: through the
orchestrator's HTTP API (a lean keep-alive client, or httpx) and straight to the workers
(``orchestrator.disagg.generate_disaggregated``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import httpx

from kvroute.bench.lean_http import LeanConnection
from kvroute.bench.meters import CpuMeter

# A fixed prompt of plain token ids, shorter than one KV block: no prefix-cache hit can
# make one request cheaper than another, so every request does the same work.
# SmolLM2's tokens for "The capital of France is Paris. The capital of Italy is Rome. The
# capital of Germany is" (19 tokens).
PROMPT_TOKEN_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 7158, 314, 7268, 30, 378, 3575, 282,
                    4521, 314]


class Paths:
    """The two ways to run the same request, sharing one event loop."""

    def __init__(self, args: argparse.Namespace, url: str, model_name: str, prefill_address: str,
                 decode_address: str):
        from foundation import wire
        from orchestrator.worker_client import WorkerClient

        self.args = args
        self.model_name = model_name
        limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2)
        self.http = httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits)
        parsed = httpx.URL(url)
        self.host, self.port = parsed.host, parsed.port
        # Idle lean connections, one per concurrent client at most. The lean client keeps the
        # client library's own CPU time, which shares these cores, out of the orchestrator's
        # overhead; the httpx kind shows what a general-purpose client adds on top.
        self.lean: list[LeanConnection] = []
        self.prefill = WorkerClient(prefill_address)
        self.decode = WorkerClient(decode_address)
        # What orchestrator.api._job builds for temperature 0, ignore_eos, no seed.
        self.sampling = wire.SamplingSpec(max_tokens=args.max_tokens, temperature=0.0, top_p=1.0,
                                          ignore_eos=True)
        self.body = {"model": model_name, "prompt": PROMPT_TOKEN_IDS, "max_tokens": args.max_tokens,
                     "temperature": 0, "ignore_eos": True}
        self.meter: CpuMeter | None = None  # the orchestrator process, once known
        self.rejected = 0  # 429 answers (retried after a short pause, inside the measured time)
        self.idle_cpu_rate = 0.0

    async def close(self) -> None:
        await self.http.aclose()
        for connection in self.lean:
            await connection.close()
        await self.prefill.close()
        await self.decode.close()

    async def http_request(self) -> dict:
        return await self._completion(lean=True)

    async def http_request_httpx(self) -> dict:
        return await self._completion(lean=False)

    async def _completion(self, lean: bool) -> dict:
        start = time.perf_counter()
        status, body = await self._post(self.body, lean)
        while status == 429:
            self.rejected += 1
            await asyncio.sleep(0.05)
            status, body = await self._post(self.body, lean)
        elapsed = time.perf_counter() - start
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body}")
        tokens = body["usage"]["completion_tokens"]
        if tokens != self.args.max_tokens:
            raise RuntimeError(f"expected {self.args.max_tokens} tokens through the API, got {tokens}: {body}")
        return {"latency_s": elapsed, "text": body["choices"][0]["text"]}

    async def _post(self, body: dict, lean: bool) -> tuple[int, dict]:
        if not lean:
            response = await self.http.post("/v1/completions", json=body)
            return response.status_code, response.json()
        connection = self.lean.pop() if self.lean else LeanConnection(self.host, self.port)
        try:
            return await connection.post_json("/v1/completions", body)
        finally:
            self.lean.append(connection)

    async def _events(self, body: dict) -> AsyncIterator[str]:
        connection = self.lean.pop() if self.lean else LeanConnection(self.host, self.port)
        try:
            async for data in connection.post_sse("/v1/completions", body):
                yield data
        finally:
            self.lean.append(connection)

    async def http_stream(self) -> dict:
        start = time.perf_counter()
        first = None
        text = []
        async with aclosing(self._events({**self.body, "stream": True})) as events:
            async for data in events:
                if data == "[DONE]":
                    continue  # read on to the end of the body: the connection is reused
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"stream error: {event}")
                if event.get("choices"):
                    first = first or time.perf_counter()
                    text.append(event["choices"][0]["text"])
        done = time.perf_counter()
        return {"ttft_s": first - start, "latency_s": done - start, "text": "".join(text)}

    async def direct(self) -> dict:
        from orchestrator.disagg import HandoffRecord, generate_disaggregated

        record = HandoffRecord(request_id=f"direct-{uuid.uuid4().hex}")
        start = time.perf_counter()
        first = None
        async for chunk in generate_disaggregated(self.prefill, self.decode, record, list(PROMPT_TOKEN_IDS),
                                                  self.sampling, None, self.args.request_timeout):
            if chunk.token_ids and first is None:
                first = time.perf_counter()
        elapsed = time.perf_counter() - start
        if len(record.token_ids) != self.args.max_tokens:
            raise RuntimeError(f"expected {self.args.max_tokens} tokens directly, got {record.token_ids}")
        return {"latency_s": elapsed, "ttft_s": first - start, "token_ids": list(record.token_ids)}
