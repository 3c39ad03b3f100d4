"""Serving one completion: place it, drive it through the workers, turn tokens into text.

::

    Job ──place──▶ (prefill, decode) ──generate_disaggregated──▶ token chunks
                                          └─ TextStream: detokenize, stop strings ─▶ Delta…

The caller iterates ``stream(job)``; leaving early (client gone, stop string hit)
closes the worker stream, which aborts the request on both workers and frees the lease.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from kvroute import wire
from orchestrator.disagg import HandoffRecord, generate_disaggregated
from orchestrator.errors import APIError
from orchestrator.fleet import Fleet
from orchestrator.metrics import Metrics
from orchestrator.placement import Candidate, NoWorkerAvailable, Placement, place
from orchestrator.tokenization import TextCodec
from orchestrator.worker_client import WorkerError


@dataclass
class Job:
    prompt_token_ids: list[int]
    sampling: wire.SamplingSpec
    stop: list[str] = field(default_factory=list)
    cache_salt: str | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrived_at: float = field(default_factory=time.perf_counter)


@dataclass
class Delta:
    text: str
    finish_reason: str | None = None


@dataclass
class Outcome:
    """Filled in while a job streams; read for usage once it finished."""

    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    placement: Placement | None = None


class CompletionService:
    def __init__(self, fleet: Fleet, codec: TextCodec, policy, metrics: Metrics, worker_timeout: float):
        self.fleet = fleet
        self.codec = codec
        self.policy = policy
        self.metrics = metrics
        self.worker_timeout = worker_timeout

    def place(self) -> Placement:
        try:
            return place(self.policy, self._candidates("prefill"), self._candidates("decode"))
        except NoWorkerAvailable as error:
            raise APIError(503, f"cannot serve right now: {error}", code="no_worker",
                           headers={"Retry-After": "5"}) from error

    def _candidates(self, role: str) -> list[Candidate]:
        return [Candidate(view, self.fleet.in_flight(view.worker_id)) for view in self.fleet.live(role)]

    async def stream(self, job: Job, outcome: Outcome) -> AsyncIterator[Delta]:
        placement = outcome.placement = self.place()
        prefill, decode = self.fleet.client(placement.prefill.worker_id), self.fleet.client(placement.decode.worker_id)
        if prefill is None or decode is None:
            raise APIError(503, "the chosen worker just went away; retry", code="no_worker")
        record = HandoffRecord(request_id=job.request_id)
        self._track(placement, +1)
        try:
            tokens = generate_disaggregated(prefill, decode, record, job.prompt_token_ids, job.sampling,
                                            job.cache_salt, self.worker_timeout)
            async with aclosing(tokens):
                async for delta in self._detokenize(tokens, job, outcome):
                    yield delta
        except WorkerError as error:
            role = "decode" if record.first_token_at else "prefill"
            self.metrics.worker_failures.labels(role).inc()
            raise APIError(503, f"{role} worker failed: {error}", code="worker_error") from error
        finally:
            self._track(placement, -1)
            outcome.cached_tokens = record.prefill_cached_tokens
            self._observe(job, record, outcome)

    async def _detokenize(self, chunks, job: Job, outcome: Outcome) -> AsyncIterator[Delta]:
        text = self.codec.text_stream(job.stop)
        async for chunk in chunks:
            outcome.completion_tokens += len(chunk.token_ids)
            piece = text.push(chunk.token_ids)
            if text.stopped:
                outcome.finish_reason = "stop"
            elif chunk.finished:
                outcome.finish_reason = "stop" if chunk.finish_reason == "stop" else "length"
                piece += text.finish()
            if piece or outcome.finish_reason:
                yield Delta(piece, outcome.finish_reason)
            if outcome.finish_reason:
                return

    def _track(self, placement: Placement, delta: int) -> None:
        self.fleet.track(placement.prefill.worker_id, delta)
        self.fleet.track(placement.decode.worker_id, delta)
        self.metrics.in_flight.inc(delta)

    def _observe(self, job: Job, record: HandoffRecord, outcome: Outcome) -> None:
        m = self.metrics
        m.prompt_tokens.inc(len(job.prompt_token_ids))
        m.cached_tokens.inc(record.prefill_cached_tokens)
        m.generation_tokens.inc(outcome.completion_tokens)
        if record.first_token_at is None:
            return
        m.ttft.observe(record.first_token_at - job.arrived_at)
        if record.second_token_at is not None:
            m.second_token.observe(record.second_token_at - record.first_token_at)
        done = time.perf_counter()
        m.e2e.observe(done - job.arrived_at)
        later_tokens = len(record.token_ids) - 2
        if later_tokens > 0 and record.second_token_at is not None:
            m.inter_token.observe((done - record.second_token_at) / later_tokens)
