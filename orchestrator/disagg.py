"""Driving one request through prefill worker → KV transfer → decode worker.

::

    prefill worker: prompt, max_tokens=1, hold_blocks ──▶ t1 + PullSource (lease)
         │ t1 is yielded to the caller at once (early first token)
         ├─ t1 ends the request ──▶ release the lease now, done
         ▼
    decode worker: prompt + [t1], max_tokens-1, pull_from=PullSource
         │ its connector pulls only the blocks it lacks, computes the tail
         ▼ tokens 2..N streamed back

If anything fails or the caller stops early, both workers get an abort and the lease
is released, so no blocks stay held on the producer.

A PULL (``generate_pulled``) hands a cached prefix from one replica to another::

    source: prompt[:lend], max_tokens=1, hold_blocks ──▶ PullSource (lease); its token is dropped
    sink:   prompt, pull_from=PullSource ──▶ pulls the lent blocks it lacks, computes the rest, decodes

A lend that fails costs only the pull: the sink then computes the whole prompt itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from foundation import wire
from foundation.endpoint_client import release_lease
from orchestrator.decode_streams import Stall
from orchestrator.worker_client import WorkerClient, WorkerError, WorkerTimeout

logger = logging.getLogger("kvroute.orchestrator.disagg")

OnTimeout = Callable[[WorkerTimeout], None]  # see WorkerClient.generate


@dataclass(frozen=True)
class Patience:
    """A disaggregated request's timeout handlers, one per worker."""

    prefill: OnTimeout
    decode: OnTimeout


@dataclass
class HandoffRecord:
    """What happened to one disaggregated request, for logs and decision records."""

    request_id: str
    prompt_tokens: int = 0
    prefill_cached_tokens: int = 0
    prefill_tier_tokens: int = 0  # of those, loaded from the prefilling worker's node KV tier
    prefill_tier_seconds: float = 0.0  # from the tier lookup's start to the load's end
    pull_source: wire.PullSource | None = None
    first_token_at: float | None = None
    second_token_at: float | None = None
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    transfer: wire.PullRecord | None = None  # as the decode worker's connector measured it
    lend_error: WorkerError | None = None  # a PULL's source failed to lend; the sink recomputed
    # What the prefill stalled the streams decoding on its worker (``orchestrator.decode_streams``);
    # None when none was measured (no stream there, or the worker does not decode).
    prefill_stall: Stall | None = None


def first_token_ends(chunk: wire.GenerateChunk, sampling: wire.SamplingSpec) -> bool:
    """Whether the prefill worker's single token already finishes the request."""
    return sampling.max_tokens <= 1 or chunk.finish_reason == "stop"


def prefill_sampling(sampling: wire.SamplingSpec) -> wire.SamplingSpec:
    return msgspec.structs.replace(sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1))


def decode_sampling(sampling: wire.SamplingSpec) -> wire.SamplingSpec:
    return msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - 1,
                                   min_tokens=max(sampling.min_tokens - 1, 0))


async def generate_disaggregated(prefill: WorkerClient, decode: WorkerClient, record: HandoffRecord,
                                 prompt_token_ids: list[int], sampling: wire.SamplingSpec,
                                 cache_salt: str | None = None, timeout: float = 60.0,
                                 patience: Patience | None = None,
                                 trace_context: dict[str, str] | None = None) -> AsyncIterator[wire.GenerateChunk]:
    """Yield chunks of generated tokens; ``record`` is filled in as the request runs.
    ``patience``: for each worker, what to do when ``timeout`` passes with no token.
    ``trace_context``: the parent of both workers' spans (``foundation.tracing.carrier``)."""
    record.prompt_tokens = len(prompt_token_ids)
    first = await _prefill(prefill, record, prompt_token_ids, sampling, cache_salt, timeout,
                           patience and patience.prefill, trace_context)
    source = first.pull_source
    ends = first_token_ends(first, sampling)
    head = msgspec.structs.replace(first, finished=ends, pull_source=None,
                                   finish_reason=first.finish_reason if ends else None)
    _observe(record, head)
    try:
        yield head
        if ends:
            return
        async for chunk in decode.generate(wire.GenerateRequest(
                request_id=record.request_id, prompt_token_ids=prompt_token_ids + first.token_ids,
                sampling=decode_sampling(sampling), cache_salt=cache_salt, pull_from=source,
                trace_context=trace_context), timeout,
                patience and patience.decode):
            _observe(record, chunk)
            source = None if chunk.finished else source  # the consumer owns the lease now
            yield chunk
    finally:
        if source is not None:
            await release(source, "abort" if not ends else "first_token_finished")


async def generate_pulled(source: WorkerClient, sink: WorkerClient, record: HandoffRecord,
                          prompt_token_ids: list[int], lend_tokens: int, sampling: wire.SamplingSpec,
                          cache_salt: str | None = None, timeout: float = 60.0,
                          patience: Patience | None = None,
                          trace_context: dict[str, str] | None = None) -> AsyncIterator[wire.GenerateChunk]:
    """The PULL plan: ``source`` lends the prompt's first ``lend_tokens`` tokens (whole blocks it
    holds cached); ``sink`` pulls them, computes the rest and generates every token."""
    lease = None
    lend = HandoffRecord(request_id=f"{record.request_id}-lend")
    try:
        lent = await _prefill(source, lend, prompt_token_ids[:lend_tokens], sampling, cache_salt, timeout,
                              patience and patience.prefill, trace_context)
        lease = lent.pull_source
    except WorkerError as error:
        record.lend_error = error
        logger.warning("request %s: lending %d tokens failed (%s); the sink computes them", record.request_id,
                       lend_tokens, error)
    try:
        request = wire.GenerateRequest(request_id=record.request_id, prompt_token_ids=prompt_token_ids,
                                       sampling=sampling, cache_salt=cache_salt, pull_from=lease,
                                       trace_context=trace_context)
        async for chunk in _generate(sink, record, request, timeout, patience and patience.decode):
            lease = None if chunk.finished else lease  # a finished sink request gave the lease back
            yield chunk
    finally:
        if lease is not None:
            await release(lease, "abort")


async def _prefill(prefill: WorkerClient, record: HandoffRecord, prompt_token_ids: list[int],
                   sampling: wire.SamplingSpec, cache_salt: str | None, timeout: float,
                   on_timeout: OnTimeout | None, trace_context: dict[str, str] | None) -> wire.GenerateChunk:
    request = wire.GenerateRequest(request_id=record.request_id, prompt_token_ids=prompt_token_ids,
                                   sampling=prefill_sampling(sampling), cache_salt=cache_salt, hold_blocks=True,
                                   trace_context=trace_context)
    chunks = [chunk async for chunk in prefill.generate(request, timeout, on_timeout)]
    first = chunks[-1]
    first.token_ids = [t for chunk in chunks for t in chunk.token_ids]
    first.logprobs = [lp for chunk in chunks for lp in (chunk.logprobs or [])] or None
    record.prefill_cached_tokens = first.num_cached_tokens
    record.prefill_tier_tokens, record.prefill_tier_seconds = first.num_tier_tokens, first.tier_seconds
    record.pull_source = first.pull_source
    return first


async def generate_local(decode: WorkerClient, record: HandoffRecord, prompt_token_ids: list[int],
                         sampling: wire.SamplingSpec, cache_salt: str | None = None, timeout: float = 60.0,
                         on_timeout: OnTimeout | None = None,
                         trace_context: dict[str, str] | None = None) -> AsyncIterator[wire.GenerateChunk]:
    """The LOCAL plan: the decode worker prefills the prompt itself, using its own cache."""
    request = wire.GenerateRequest(request_id=record.request_id, prompt_token_ids=prompt_token_ids,
                                   sampling=sampling, cache_salt=cache_salt, trace_context=trace_context)
    async for chunk in _generate(decode, record, request, timeout, on_timeout):
        yield chunk


async def _generate(worker: WorkerClient, record: HandoffRecord, request: wire.GenerateRequest, timeout: float,
                    on_timeout: OnTimeout | None) -> AsyncIterator[wire.GenerateChunk]:
    """One worker prefills (with its cache and any pull) and decodes the whole request."""
    record.prompt_tokens = len(request.prompt_token_ids)
    async for chunk in worker.generate(request, timeout, on_timeout):
        if record.first_token_at is None:
            record.prefill_cached_tokens = chunk.num_cached_tokens
        if chunk.num_tier_tokens:  # said with the last chunk, when the engine's connector knows
            record.prefill_tier_tokens, record.prefill_tier_seconds = chunk.num_tier_tokens, chunk.tier_seconds
        _observe(record, chunk)
        yield chunk


def _observe(record: HandoffRecord, chunk: wire.GenerateChunk) -> None:
    now = time.perf_counter()
    for _ in chunk.token_ids:
        if record.first_token_at is None:
            record.first_token_at = now
        elif record.second_token_at is None:
            record.second_token_at = now
    record.token_ids.extend(chunk.token_ids)
    if chunk.transfer is not None:
        record.transfer = chunk.transfer
    if chunk.finished:
        record.finish_reason = chunk.finish_reason


async def release(source: wire.PullSource, reason: str) -> bool:
    """Give a lease back to its producer (best effort; the lease expires anyway)."""
    released = await asyncio.to_thread(release_lease, zmq.Context.instance(), source.address,
                                       source.handle, reason)
    logger.debug("lease release (%s): %s", reason, released)
    return released
