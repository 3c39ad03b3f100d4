"""Serving one completion: plan it, drive it through the workers, turn tokens into text.

::

    Job ─▶ block hashes (namespace salt) ─▶ index match ─▶ WorkerViews ─▶ policy.decide
        ─▶ LOCAL: decode worker prefills itself  │ DISAGG: prefill worker → KV pull → decode worker
        ─▶ TextStream (detokenize, stop strings) ─▶ Delta…
        ─▶ decision record completed with actuals; feedback to the index and the cost model

The caller iterates ``stream(job)``; leaving early (client gone, stop string hit)
closes the worker stream, which aborts the request on the workers and frees the lease.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec

from foundation import identity, tracing, wire
from orchestrator.circuit_breaker import DRAINING_CODE, counts_against_worker
from orchestrator.core_sharing import with_core_neighbours
from orchestrator.decisions import DecisionLog, DecisionRecord
from orchestrator.decode_streams import DecodeStreams
from orchestrator.disagg import (
    HandoffRecord,
    OnTimeout,
    Patience,
    generate_disaggregated,
    generate_local,
    generate_pulled,
)
from orchestrator.errors import APIError
from orchestrator.feedback import Feedback
from orchestrator.fleet import Fleet
from orchestrator.followers import followable_blocks
from orchestrator.index import PrefixIndex
from orchestrator.load_ledger import QueuedWork
from orchestrator.metrics import Metrics
from orchestrator.planner.calibration import Calibration
from orchestrator.planner.candidates import load_key
from orchestrator.planner.pools import LazyPool, LoadKey
from orchestrator.planner.views import Decision, Plan, PlanKind, RequestView, WorkerView
from orchestrator.queue_patience import QueuePatience
from orchestrator.recent_activity import RecentActivity
from orchestrator.request_tracing import describe, placement_span
from orchestrator.tier_holdings import TierHoldings
from orchestrator.tokenization import TextCodec
from orchestrator.worker_client import WorkerError

logger = logging.getLogger("kvroute.orchestrator.service")

DEFAULT_BLOCK_SIZE = 128
ADMISSION_REPLAN_SECONDS = 0.25  # a quarter of the default heartbeat interval


@dataclass
class Job:
    prompt_token_ids: list[int]
    sampling: wire.SamplingSpec
    cache_salt: str
    stop: list[str] = field(default_factory=list)
    policy: str | None = None  # None: the orchestrator's configured policy
    tenant: str = "anonymous"  # whose request: its decision records are readable by that tenant only
    response_id: str = ""
    choice_index: int = 0
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrived_at: float = field(default_factory=time.perf_counter)
    # The API call's span (orchestrator.request_tracing): the parent of its placements' and workers' spans.
    trace_span: tracing.Span = field(default=tracing.NO_SPAN, repr=False, compare=False)
    _block_hashes: dict[int, list[identity.BlockHash]] = field(default_factory=dict, init=False, repr=False,
                                                              compare=False)

    @property
    def tpot_target(self) -> float:
        """Seconds a token its stream should average once decoding; 0: none. Its sampling
        carries it, so that the decoding engine keeps it too."""
        return self.sampling.tpot_target

    def block_hashes(self, block_size: int) -> list[identity.BlockHash]:
        """The prompt's full blocks, chained in the job's cache namespace, as the index keys
        them. Hashed once: every re-plan while the job waits for capacity, and the claim
        after dispatch, read the same list."""
        hashes = self._block_hashes.get(block_size)
        if hashes is None:
            hashes = self._block_hashes[block_size] = identity.block_hashes(self.prompt_token_ids, block_size,
                                                                            self.cache_salt)
        return hashes


@dataclass
class Delta:
    text: str
    finish_reason: str | None = None


@dataclass
class Outcome:
    """Filled in while a job streams; read for usage once it finished."""

    completion_tokens: int = 0
    cached_tokens: int = 0
    tier_tokens: int = 0  # of cached_tokens, loaded from the node KV tier
    finish_reason: str | None = None
    record: DecisionRecord | None = None  # the first placement's
    generated_token_ids: list[int] = field(default_factory=list)


class _WorkerFailed(Exception):
    def __init__(self, role: str, worker_id: str, error: WorkerError):
        super().__init__(str(error))
        self.role, self.worker_id, self.error = role, worker_id, error


def continuation(job: Job, generated: list[int], attempt: int) -> Job:
    """The rest of ``job`` after ``generated`` tokens: they join the prompt, and the
    output budget shrinks by as many, so the client sees one uninterrupted completion."""
    sampling = msgspec.structs.replace(job.sampling, max_tokens=job.sampling.max_tokens - len(generated),
                                       min_tokens=max(job.sampling.min_tokens - len(generated), 0))
    return dataclasses.replace(job, prompt_token_ids=job.prompt_token_ids + generated, sampling=sampling,
                               request_id=f"{job.request_id}-m{attempt}")


def heartbeat_load_key(load: wire.WorkerLoad, in_flight: int, worker_id: str) -> LoadKey:
    """``load_key`` of the view ``CompletionService._view`` builds for a worker whose
    heartbeat the ledger leaves as it is, without building the view."""
    return max(load.num_running + load.num_waiting, in_flight), load.num_queued_prefill_tokens, worker_id


class CompletionService:
    def __init__(self, fleet: Fleet, codec: TextCodec, policies, default_policy: str, metrics: Metrics,
                 index: PrefixIndex, decisions: DecisionLog, calibration: Calibration, feedback: Feedback,
                 worker_timeout: float, admission_wait: float = 10.0, max_attempts: int = 3,
                 queue_wait_limit: float = 600.0, activity: RecentActivity | None = None,
                 tiers: TierHoldings | None = None, streams: DecodeStreams | None = None):
        """``tiers``: what the node KV stores hold (None: no worker uses one); ``streams``: the
        streams decoding on each worker, kept from the tokens relayed here."""
        self.fleet, self.codec, self.metrics = fleet, codec, metrics
        self.tiers = tiers or TierHoldings()
        self.streams = streams or DecodeStreams()
        self.activity = activity or RecentActivity()  # the status page's last minutes
        self.policies, self.default_policy = policies, default_policy
        self.index, self.decisions, self.calibration, self.feedback = index, decisions, calibration, feedback
        self.worker_timeout = worker_timeout
        self.admission_wait = admission_wait
        self.max_attempts = max_attempts
        self.queue_wait_limit = queue_wait_limit
        self._capacity_freed = asyncio.Event()

    # ------------------------------------------------------------ planning

    async def admit(self, job: Job, excluded: set[str] = frozenset()) -> tuple[Decision, DecisionRecord]:
        """Plan the job; while every worker is at its cap, wait for capacity a bounded time."""
        deadline = time.monotonic() + self.admission_wait
        while True:
            decision, record = self.plan(job, excluded)
            if decision.chosen is not None:
                return decision, record
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.metrics.rejected.inc()
                raise APIError(429, f"every worker is at capacity: {decision.reason}", code="overloaded",
                               headers={"Retry-After": "2"})
            # Re-plan when a request here finishes, or at the latest when new heartbeats
            # may have arrived: room can also come from work other replicas finished.
            self._capacity_freed.clear()
            self.metrics.awaiting_capacity.inc()
            try:
                await asyncio.wait_for(self._capacity_freed.wait(), min(remaining, ADMISSION_REPLAN_SECONDS))
            except TimeoutError:
                pass
            finally:
                self.metrics.awaiting_capacity.dec()

    def plan(self, job: Job, excluded: set[str] = frozenset()) -> tuple[Decision, DecisionRecord | None]:
        """``excluded``: workers that already failed this job (the registry may not know yet)."""
        block_size = self._block_size()
        self.index.expire_claims(time.monotonic())
        block_hashes = job.block_hashes(block_size)
        matches = self.index.match(block_hashes)
        prefill = self.worker_views("prefill", block_hashes, matches, excluded)
        decode = self.worker_views("decode", block_hashes, matches, excluded)
        prefill, decode = self._with_core_neighbours(prefill, decode)
        if not prefill or not decode:
            raise APIError(503, f"cannot serve right now: no live {'prefill' if not prefill else 'decode'} "
                                f"worker", code="no_worker", headers={"Retry-After": "5"})
        request = RequestView(job.request_id, len(job.prompt_token_ids), job.sampling.max_tokens, block_size)
        policy = self.policies[job.policy or self.default_policy]
        decision = policy.decide(request, prefill, decode, self.calibration.calibrated_model(time.monotonic()))
        if decision.chosen is None:
            return decision, None
        chosen = decision.chosen
        stored = self.index.stored_prefix(chosen.source_worker or chosen.prefilling_worker, block_hashes)
        record = DecisionRecord.from_decision(decision, job.response_id, job.choice_index, job.request_id,
                                              len(job.prompt_token_ids), block_size, stored * block_size,
                                              job.tenant)
        self.decisions.add(record)
        return decision, record

    def _block_size(self) -> int:
        sizes = (w.load.block_size for role in wire.ROLES for w in self.fleet.live(role))
        return next((size for size in sizes if size), DEFAULT_BLOCK_SIZE)

    def worker_views(self, pool: str, block_hashes: list[identity.BlockHash], matches: dict[str, int],
                     excluded: set[str]) -> LazyPool:
        """The live workers of ``pool`` (``wire.POOLS``; less ``excluded``) as ``plan`` shows them to a policy:
        views built as the policy reads them (``orchestrator.planner.pools``), for a prompt of
        ``block_hashes`` whose cached blocks per worker are ``matches`` (``PrefixIndex.match``).
        A worker whose heartbeat the ledger has nothing to correct for is keyed by its
        heartbeat alone; the others' views are built now, as their keys need the ledger."""
        workers = [w for w in self.fleet.pool(pool) if w.worker_id not in excluded]
        cached = [matches.get(w.worker_id, 0) for w in workers]
        reachable = cached
        if self.tiers.num_stores:  # else no worker has a store run to add: skip a pass over the pool
            reach = self.tiers.reach(block_hashes)
            reachable = [reach(worker.node_store, blocks) for worker, blocks in zip(workers, cached)]

        def build(position: int) -> WorkerView:
            return self._view(workers[position], block_hashes, cached[position])

        built, load_keys = {}, []
        for position, worker in enumerate(workers):
            if self.fleet.ledger.heartbeat_is_current(worker.worker_id):
                load_keys.append(heartbeat_load_key(worker.load, self.fleet.in_flight(worker.worker_id),
                                                    worker.worker_id))
            else:
                built[position] = build(position)
                load_keys.append(load_key(built[position]))
        return LazyPool(load_keys, reachable, build, built)

    def _with_core_neighbours(self, prefill: Sequence[WorkerView],
                              decode: Sequence[WorkerView]) -> tuple[Sequence[WorkerView], Sequence[WorkerView]]:
        bindings = {w.worker_id: w.cores for role in wire.ROLES for w in self.fleet.live(role) if w.cores}
        if not bindings:
            return prefill, decode
        views = with_core_neighbours([*prefill, *decode], bindings)
        return views[:len(prefill)], views[len(prefill):]

    def _view(self, worker, block_hashes: list[identity.BlockHash], matched: int) -> WorkerView:
        load, now = worker.load, time.monotonic()
        reported = QueuedWork(load.num_waiting, load.num_queued_prefill_tokens, load.queued_prefill,
                              head_age=load.head_prompt_age + max(0.0, now - worker.last_seen))
        queued = self.fleet.ledger.queued(worker.worker_id, reported, now)
        block_size = load.block_size or DEFAULT_BLOCK_SIZE
        followable = followable_blocks(self.index, worker.worker_id, block_hashes, matched,
                                       tuple(queued.per_request or ()), load.prompt_step_cap, block_size)
        tier = self.tiers.run(worker.node_store, block_hashes, matched)
        return WorkerView(worker_id=worker.worker_id, role=worker.role,
                          num_running=self.fleet.ledger.running(worker.worker_id, load.num_running),
                          num_waiting=queued.num_waiting, num_queued_prefill_tokens=queued.num_queued_prefill_tokens,
                          num_free_blocks=self.fleet.ledger.free_blocks(worker.worker_id, load.num_free_blocks,
                                                                        load.num_total_blocks),
                          num_total_blocks=load.num_total_blocks,
                          block_size=block_size, bytes_per_block=load.bytes_per_block,
                          in_flight=self.fleet.in_flight(worker.worker_id), cached_blocks=matched,
                          followable_blocks=followable,
                          resident_blocks=self.index.num_blocks(worker.worker_id),
                          queued_prompts=None if queued.per_request is None else tuple(queued.per_request.values()),
                          head_prompt_elapsed=queued.head_age, prompt_step_cap=load.prompt_step_cap,
                          tier_host_blocks=tier.host_blocks, tier_disk_blocks=tier.disk_blocks,
                          decoding=self.streams.on(worker.worker_id))

    # ------------------------------------------------------------ running

    async def stream(self, job: Job, outcome: Outcome) -> AsyncIterator[Delta]:
        """The job's text as it is generated. A worker that fails mid-request costs latency,
        not the request: the job moves to another worker with the prompt plus the tokens
        already sent (greedy decoding then continues exactly where it stopped), up to
        ``max_attempts`` placements, after which the client gets a 503."""
        text = self.codec.text_stream(job.stop)
        excluded: set[str] = set()
        attempt = job
        for number in range(1, self.max_attempts + 1):
            try:
                async for delta in self._attempt(attempt, job, outcome, text, excluded):
                    yield delta
                return
            except _WorkerFailed as failure:
                excluded.add(failure.worker_id)
                if number == self.max_attempts or outcome.completion_tokens >= job.sampling.max_tokens:
                    raise APIError(503, f"{failure.role} worker failed: {failure.error}",
                                   code="worker_error") from failure.error
                if failure.error.code != DRAINING_CODE:
                    self.metrics.migrations.labels(failure.role).inc()
                    logger.warning("request %s: %s worker %s failed (%s) after %d tokens; moving it (attempt %d)",
                                   job.request_id, failure.role, failure.worker_id, failure.error,
                                   outcome.completion_tokens, number + 1)
                else:  # it raced onto a worker that is draining: a redirect, not a failure
                    logger.info("request %s: %s worker %s is draining; placing it elsewhere",
                                job.request_id, failure.role, failure.worker_id)
                attempt = continuation(job, outcome.generated_token_ids, number)

    async def _attempt(self, attempt: Job, job: Job, outcome: Outcome, text,
                       excluded: set[str]) -> AsyncIterator[Delta]:
        """One placement of the job (the first, or a continuation after a failure)."""
        with placement_span(attempt.trace_span, attempt.request_id) as span:
            decision, record = await self.admit(attempt, excluded)
            describe(span, decision)
        if outcome.record is None:
            outcome.record = record
        plan = decision.chosen
        handoff = HandoffRecord(request_id=attempt.request_id)
        idle_at_start = all(self.fleet.in_flight(w) == 0 for w in plan.workers)
        self._track(plan, +1)
        prefilling = plan.prefilling_worker
        self._reserve(plan, attempt, prefilling, record.block_size)
        self._claim(prefilling, attempt, record.block_size)
        health: tuple[bool, _WorkerFailed | None] = (False, None)  # unchanged if the client leaves
        try:
            relayed = self._relayed(self._tokens(plan, attempt, handoff), plan, attempt, handoff, time.perf_counter())
            chunks = self._until_prefilled(relayed, prefilling, attempt)
            async with aclosing(chunks) as tokens:
                async for delta in self._detokenize(tokens, outcome, text):
                    yield delta
            health = (True, None)
        except WorkerError as error:
            # A PULL's lend failing is not fatal (the sink computes the prompt): only the sink fails it.
            role = "decode" if handoff.first_token_at or plan.kind is not PlanKind.DISAGG else "prefill"
            if counts_against_worker(error):  # a draining worker is leaving, not failing
                self.metrics.worker_failures.labels(role).inc()
            record.actual.error = str(error)
            failure = _WorkerFailed(role, plan.decode_worker if role == "decode" else plan.prefill_worker, error)
            health = (False, failure)
            raise failure from error
        finally:
            self._report_health(plan, *health)
            if handoff.lend_error is not None and counts_against_worker(handoff.lend_error):
                self.fleet.breakers.failed(plan.source_worker, time.monotonic())
            self.fleet.ledger.prefilled(prefilling, attempt.request_id, time.monotonic())
            self.fleet.ledger.released(plan.decode_worker, attempt.request_id)
            if handoff.first_token_at is None:  # failed, or the client left: nothing stored to count on
                self.index.release(prefilling, attempt.request_id)
            self._track(plan, -1)
            if attempt is job:
                outcome.cached_tokens = handoff.prefill_cached_tokens
                outcome.tier_tokens = handoff.prefill_tier_tokens
            self._complete(attempt, plan, handoff, outcome, record, idle_at_start, client_facing=attempt is job)

    def _report_health(self, plan: Plan, ok: bool, failure: _WorkerFailed | None) -> None:
        """Feed the circuit breakers: a finished placement is a success for all its workers;
        a failure counts against the failed worker only (and not when the request itself was
        at fault); a placement that ended otherwise (the client left) says nothing."""
        now = time.monotonic()
        for worker_id in plan.workers:
            if ok:
                self.fleet.breakers.succeeded(worker_id, now)
            elif failure is not None and worker_id == failure.worker_id and counts_against_worker(failure.error):
                self.fleet.breakers.failed(worker_id, now)
            else:
                self.fleet.breakers.released(worker_id, now)

    def _tokens(self, plan: Plan, job: Job, handoff: HandoffRecord) -> AsyncIterator[wire.GenerateChunk]:
        decode = self._client(plan.decode_worker)
        trace_context = tracing.carrier(job.trace_span)  # the workers' spans join the request's trace
        if plan.kind is PlanKind.LOCAL:
            return generate_local(decode, handoff, job.prompt_token_ids, job.sampling, job.cache_salt,
                                  self.worker_timeout, self._patience(plan.decode_worker, job), trace_context)
        lender = plan.lending_worker
        patience = Patience(prefill=self._patience(lender, job), decode=self._patience(plan.decode_worker, job))
        if plan.kind is PlanKind.PULL:
            return generate_pulled(self._client(lender), decode, handoff, job.prompt_token_ids, plan.lend_tokens,
                                   job.sampling, job.cache_salt, self.worker_timeout, patience, trace_context)
        return generate_disaggregated(self._client(lender), decode, handoff, job.prompt_token_ids,
                                      job.sampling, job.cache_salt, self.worker_timeout, patience, trace_context)

    def _patience(self, worker_id: str, job: Job) -> OnTimeout:
        """A wait for ``worker_id`` that times out goes on while the worker is busy with its queue."""
        return QueuePatience(self.fleet.registry.get, worker_id, job.request_id, self.fleet.registry.heartbeat_timeout,
                             self.worker_timeout, self.queue_wait_limit).on_timeout

    def _reserve(self, plan: Plan, job: Job, prefilling: str, block_size: int) -> None:
        """Tell the ledger what this request will cost its workers until their next heartbeat."""
        reused = plan.estimate.reused_tokens if plan.estimate else 0
        self.fleet.ledger.dispatched(prefilling, job.request_id, len(job.prompt_token_ids) - reused,
                                     time.monotonic())
        lifetime_tokens = len(job.prompt_token_ids) + max(job.sampling.max_tokens, 0)
        self.fleet.ledger.reserved(plan.decode_worker, job.request_id, -(-lifetime_tokens // block_size))

    def _claim(self, prefilling: str, job: Job, block_size: int) -> None:
        """Until its KV events say so, the index counts the prompt as cached where it is
        prefilled, so requests sharing its prefix follow it there (``pending_blocks``)."""
        worker = self.fleet.registry.get(prefilling)
        capacity = worker.load.num_total_blocks if worker is not None else 0
        self.index.claim(prefilling, job.request_id, job.block_hashes(block_size), capacity, time.monotonic())

    async def _until_prefilled(self, chunks: AsyncIterator[wire.GenerateChunk], prefilling: str,
                               job: Job) -> AsyncIterator[wire.GenerateChunk]:
        """Pass chunks through; the first token means the prefilling worker's queue is shorter
        and the prompt's blocks are stored there."""
        prefilled = False
        async with aclosing(chunks):
            async for chunk in chunks:
                if not prefilled and (chunk.token_ids or chunk.finished):
                    prefilled, now = True, time.monotonic()
                    self.fleet.ledger.prefilled(prefilling, job.request_id, now)
                    self.index.settle(prefilling, job.request_id, now)
                yield chunk

    async def _relayed(self, chunks: AsyncIterator[wire.GenerateChunk], plan: Plan, job: Job, handoff: HandoffRecord,
                       dispatched_at: float) -> AsyncIterator[wire.GenerateChunk]:
        """Pass chunks through, telling the decode streams what they show: at the first token,
        that the prefill dispatched at ``dispatched_at`` ended (``handoff.prefill_stall``: what it
        stalled on its worker); then each token the job's decode worker sends. A DISAGG's first
        token comes from its prefill worker, so its stream there starts at the second."""
        first_from_prefill_worker = plan.kind is PlanKind.DISAGG
        self.streams.started(plan.decode_worker, job.request_id, job.tpot_target,
                             job.sampling.max_tokens - first_from_prefill_worker)
        self.streams.prefill_dispatched(plan.prefilling_worker, job.request_id)
        first = True
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    if chunk.token_ids:
                        if first:
                            handoff.prefill_stall = self.streams.prefilled(plan.prefilling_worker, job.request_id,
                                                                           dispatched_at, handoff.first_token_at)
                        if not (first and first_from_prefill_worker):
                            self.streams.token(plan.decode_worker, job.request_id, len(chunk.token_ids),
                                               time.perf_counter())
                        first = False
                    yield chunk
        finally:
            self.streams.ended(plan.decode_worker, job.request_id)
            if first:
                self.streams.prefill_dropped(plan.prefilling_worker, job.request_id, time.perf_counter())

    def _client(self, worker_id: str):
        client = self.fleet.client(worker_id)
        if client is None:
            raise APIError(503, f"worker {worker_id} just went away; retry", code="no_worker",
                           headers={"Retry-After": "1"})
        return client

    async def _detokenize(self, chunks, outcome: Outcome, text) -> AsyncIterator[Delta]:
        async for chunk in chunks:
            outcome.completion_tokens += len(chunk.token_ids)
            outcome.generated_token_ids.extend(chunk.token_ids)
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

    def _track(self, plan: Plan, delta: int) -> None:
        for worker_id in plan.workers:
            self.fleet.track(worker_id, delta)
        self.metrics.in_flight.inc(delta)
        if delta < 0:
            self._capacity_freed.set()

    def _complete(self, job: Job, plan: Plan, handoff: HandoffRecord, outcome: Outcome, record: DecisionRecord,
                  idle_at_start: bool, client_facing: bool = True) -> None:
        """``client_facing``: the first placement, whose latencies the client saw; a
        continuation after a failure still teaches the index and the cost model."""
        actual = record.actual
        actual.completion_tokens, actual.finish_reason = outcome.completion_tokens, outcome.finish_reason
        actual.observe(handoff, job.arrived_at, time.perf_counter())
        if client_facing:
            self.metrics.observe_request(job, plan, handoff, record)
            self.activity.observe(time.time(), record.prompt_tokens, actual.reused_tokens, actual.ttft,
                                  failed=actual.error is not None)
        prefilling = self.fleet.registry.get(plan.prefilling_worker)
        self.feedback.observe(plan, record, idle_at_start, prefilling.role if prefilling else None,
                              prefilling.load.bytes_per_block if prefilling else 0)
        self.decisions.finish(record)
