"""Open-loop replay of requests against a running cluster, one policy at a time, measured per request.

Each ``ReplayItem`` is sent at its arrival time whatever the earlier ones are doing (open
loop: a slow policy builds a queue instead of slowing the arrivals), as a streaming
OpenAI request with the header ``X-KVRoute-Policy``. On the client, per request::

    sent ──▶ first content chunk ──▶ second ──▶ ... ──▶ last chunk + usage ──▶ [DONE]
            └ ttft ┘└ second_token ┘            itl = (last − first) / (completion tokens − 1)
    └──────────────────────────────── e2e ──────────────────────────────────────┘

Prompt and cached tokens come from the final usage chunk (``prompt_tokens_details``);
after all requests finished, ``GET /v1/decisions/{id}`` adds the plan (LOCAL or DISAGG),
the chosen workers, predicted vs actual reused tokens, the planner's queue-wait estimate
and the server's own timings. A record that is missing (aged out, another replica) leaves
those fields None; the request still counts.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

POLICY_HEADER = "X-KVRoute-Policy"
# Longest silence between two bytes of one response. Past the orchestrator's default
# queue-wait limit (600 s) plus one worker timeout (60 s): an overloaded cluster's late
# answer (or its 504) is recorded as the server gave it, not as the client giving up first.
REQUEST_TIMEOUT_S = 720
DECISION_FETCH_CONCURRENCY = 16
START_DELAY_S = 0.5  # so the first arrivals are not late while the first tasks are created


@dataclass(frozen=True)
class ReplayItem:
    """One request to replay: POST ``endpoint`` at ``arrival_seconds`` with ``payload()``."""

    index: int
    arrival_seconds: float
    endpoint: str  # "/v1/chat/completions" or "/v1/completions"
    # Built when sent: a trace's token-id prompts, all held at once, would not fit in memory.
    payload: Callable[[], dict] = field(repr=False)
    group: int | None = None  # what the request shares a prefix with (a repository), if known


@dataclass
class Row:
    """What one request did; times in seconds, ``sent_s`` since the run's start."""

    policy: str
    index: int
    group: int | None
    scheduled_s: float
    sent_s: float = math.nan
    status: int = 0
    error: str | None = None
    response_id: str | None = None
    ttft_s: float | None = None
    second_token_s: float | None = None  # first → second content chunk
    itl_s: float | None = None  # (last − first content chunk) / (completion tokens − 1)
    e2e_s: float | None = None
    content_chunks: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    # from the decision record
    decision_policy: str | None = None
    plan_kind: str | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    prefilling_worker: str | None = None  # the prefill worker (DISAGG) or the decode worker (LOCAL)
    predicted_reused_tokens: int | None = None
    actual_reused_tokens: int | None = None
    estimated_ttft_s: float | None = None
    estimated_gap_s: float | None = None
    queue_wait_s: float | None = None  # the planner's estimate at placement: records hold no measured queue time
    server_ttft_s: float | None = None
    server_second_token_s: float | None = None
    server_e2e_s: float | None = None
    reason: str | None = None
    chunk_times: list[float] = field(default_factory=list, repr=False)

    @property
    def succeeded(self) -> bool:
        return self.error is None and self.ttft_s is not None


@dataclass(frozen=True)
class ReplayTarget:
    """Where and as whom requests go.

    ``choose_policy``: each request names its policy in ``X-KVRoute-Policy`` (an
    orchestrator started with ``--allow-policy-override``); off, the policy is only the
    rows' label and the server places requests as it would anyone's. ``fetch_decisions``:
    after the run, ask ``/v1/decisions`` about every request; off for servers that are not
    kvroute (plain vLLM, a router), whose rows keep those fields None without a lookup.
    """

    url: str
    model: str
    api_key: str = ""
    request_timeout_s: float = REQUEST_TIMEOUT_S
    choose_policy: bool = True
    fetch_decisions: bool = True

    def headers(self, policy: str) -> dict[str, str]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {POLICY_HEADER: policy, **auth} if self.choose_policy else auth


def request_body(model: str, item: ReplayItem) -> dict:
    # Greedy and exact-length (ignore_eos), so every policy generates the same tokens.
    return {"model": model, **item.payload(), "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


def _chunk_has_content(chunk: dict) -> bool:
    return any((choice.get("delta") or {}).get("content") or choice.get("text")
               for choice in chunk.get("choices") or ())


def _read_chunk(row: Row, chunk: dict, elapsed: float) -> None:
    if "error" in chunk:
        row.error = json.dumps(chunk["error"])[:500]
        return
    row.response_id = row.response_id or chunk.get("id")
    if _chunk_has_content(chunk):
        row.chunk_times.append(elapsed)
    if usage := chunk.get("usage"):
        row.prompt_tokens = usage["prompt_tokens"]
        row.completion_tokens = usage["completion_tokens"]
        row.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _derive_latencies(row: Row) -> None:
    times = row.chunk_times
    row.content_chunks = len(times)
    if times:
        row.ttft_s = times[0]
    if len(times) >= 2:
        row.second_token_s = times[1] - times[0]
        if row.completion_tokens and row.completion_tokens > 1:
            row.itl_s = (times[-1] - times[0]) / (row.completion_tokens - 1)


async def send(client: httpx.AsyncClient, target: ReplayTarget, policy: str, item: ReplayItem, start: float) -> Row:
    """One streaming request, measured from the moment it is sent."""
    row = Row(policy, item.index, item.group, item.arrival_seconds)
    loop = asyncio.get_running_loop()
    sent = loop.time()
    row.sent_s = sent - start
    try:
        async with client.stream("POST", target.url + item.endpoint, json=request_body(target.model, item),
                                 headers=target.headers(policy)) as response:
            row.status = response.status_code
            if response.status_code != 200:
                row.error = (await response.aread()).decode(errors="replace")[:500]
                return row
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    _read_chunk(row, json.loads(line[6:]), loop.time() - sent)
        row.e2e_s = loop.time() - sent
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as error:  # KeyError: a usage chunk without counts
        row.error = f"{type(error).__name__}: {error}"
    _derive_latencies(row)
    return row


def apply_decision(row: Row, record: dict) -> None:
    """Copy what the decision record says about ``row``'s placement into it."""
    chosen = record.get("chosen") or {}
    estimate = chosen.get("estimate") or {}
    actual = record.get("actual") or {}
    row.decision_policy = record.get("policy")
    row.plan_kind = chosen.get("kind")
    row.prefill_worker = chosen.get("prefill_worker")
    row.decode_worker = chosen.get("decode_worker")
    row.prefilling_worker = row.prefill_worker or row.decode_worker
    row.predicted_reused_tokens = record.get("predicted_reused_tokens")
    row.actual_reused_tokens = actual.get("reused_tokens")
    row.estimated_ttft_s = estimate.get("ttft")
    row.estimated_gap_s = estimate.get("gap")
    row.queue_wait_s = estimate.get("queue_wait")
    row.server_ttft_s = actual.get("ttft")
    row.server_second_token_s = actual.get("second_token_gap")
    row.server_e2e_s = actual.get("e2e")
    row.reason = record.get("reason")


async def attach_decision(client: httpx.AsyncClient, target: ReplayTarget, row: Row) -> None:
    if not row.response_id:
        return
    try:
        reply = await client.get(f"{target.url}/v1/decisions/{row.response_id}", headers=target.headers(row.policy))
        if reply.status_code != 200:
            return
        record = reply.json()["data"][-1]  # a moved request's last placement is the one that finished it
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return
    apply_decision(row, record)


async def replay(target: ReplayTarget, policy: str, items: list[ReplayItem],
                 on_finished: Callable[[Row], None] | None = None) -> tuple[list[Row], float]:
    """Send ``items`` open loop on their schedule; returns the rows (in item order) and the
    seconds from the start until the last request finished."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(target.request_timeout_s, connect=10)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        loop = asyncio.get_running_loop()
        start = loop.time() + START_DELAY_S
        tasks = []
        for item in items:
            delay = start + item.arrival_seconds - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send(client, target, policy, item, start))
            if on_finished is not None:
                task.add_done_callback(lambda done: done.cancelled() or on_finished(done.result()))
            tasks.append(task)
        rows = list(await asyncio.gather(*tasks))
        duration = loop.time() - start
        if target.fetch_decisions:
            await _attach_decisions(client, target, rows)
    return rows, duration


async def _attach_decisions(client: httpx.AsyncClient, target: ReplayTarget, rows: list[Row]) -> None:
    # After the run, not during it: the lookups would compete with the measured requests.
    semaphore = asyncio.Semaphore(DECISION_FETCH_CONCURRENCY)

    async def attach(row: Row) -> None:
        async with semaphore:
            await attach_decision(client, target, row)

    await asyncio.gather(*(attach(row) for row in rows))
