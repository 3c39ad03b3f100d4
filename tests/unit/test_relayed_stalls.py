"""The service tells the decode streams what the chunks it relays show, and a prefill's
measured stall reaches the decision record and the metrics beside its estimate."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest

from foundation import wire
from orchestrator.decisions import DecisionRecord
from orchestrator.decode_streams import DecodeStreams, Stall
from orchestrator.disagg import HandoffRecord
from orchestrator.metrics import Metrics
from orchestrator.planner.views import Decision, DecodeStream, Estimate, Plan, PlanKind
from orchestrator.service import CompletionService, Job


class Clock:
    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr(time, "perf_counter", lambda: self.now)


async def chunks(clock: Clock, handoff: HandoffRecord, arrivals):
    """One token at each of ``arrivals``, stamped as ``orchestrator.disagg`` stamps the first."""
    for at in arrivals:
        clock.now = at
        handoff.first_token_at = handoff.first_token_at or at
        yield wire.GenerateChunk(request_id=handoff.request_id, token_ids=[1])


def service(streams: DecodeStreams) -> CompletionService:
    return CompletionService(None, None, {}, "cache_aware", None, None, None, None, None, worker_timeout=1.0,
                             streams=streams)


def estimate(stall: float) -> Estimate:
    return Estimate(queue_wait=0.0, prefill=0.5, transfer=0.0, ttft=0.5, gap=0.0, reused_tokens=0, transfer_bytes=0,
                    interference=stall / 4, stall=stall)


async def relay(streams: DecodeStreams, plan: Plan, job: Job, handoff: HandoffRecord, clock: Clock, arrivals):
    relayed = service(streams)._relayed(chunks(clock, handoff, arrivals), plan, job, handoff, dispatched_at=1.0)
    return [chunk async for chunk in relayed]


@pytest.fixture
def busy_d0() -> DecodeStreams:
    """d0 decoding one stream, a token every 20 ms until t = 1.0."""
    streams = DecodeStreams()
    streams.started("d0", "running", tpot_target=0.1, tokens_left=500)
    for n in range(51):
        streams.token("d0", "running", 1, n * 0.02)
    return streams


async def test_a_local_prefill_records_the_stall_it_caused_beside_its_estimate(busy_d0, monkeypatch):
    clock, plan = Clock(monkeypatch), Plan(PlanKind.LOCAL, "d0", None, estimate(stall=0.5))
    job = Job(prompt_token_ids=[1] * 300, sampling=wire.SamplingSpec(max_tokens=4), cache_salt="s")
    handoff = HandoffRecord(job.request_id)
    record = DecisionRecord.from_decision(Decision("cache_aware", plan, (plan,), "test"), "r", 0, job.request_id,
                                          300, 16, 0)
    await relay(busy_d0, plan, job, handoff, clock, [1.5, 1.52, 1.54])
    assert handoff.prefill_stall.seconds == pytest.approx(0.48) and handoff.prefill_stall.streams == 1
    record.actual.observe(handoff, arrived_at=1.0, now=1.54)
    assert record.predicted_stall_seconds == 0.5
    assert (record.actual.stall_seconds, record.actual.stalled_streams) == (pytest.approx(0.48), 1)
    metrics = Metrics()
    metrics.observe_request(job, plan, handoff, record)
    text = generate_latest(metrics.registry).decode()
    assert 'kvroute_decode_stall_seconds_count{plan="local",policy="cache_aware"} 1.0' in text
    assert busy_d0.prefilled("d0", "later", dispatched_at=2.0, now=2.1).streams == 1  # the job's stream left with it



async def test_a_disagg_stream_joins_its_decode_worker_at_its_second_token(busy_d0, monkeypatch):
    clock, plan = Clock(monkeypatch), Plan(PlanKind.DISAGG, "d0", "p0", estimate(stall=0.0))
    job = Job(prompt_token_ids=[1] * 300, sampling=wire.SamplingSpec(max_tokens=4, tpot_target=0.05), cache_salt="s")
    handoff = HandoffRecord(job.request_id)
    seen = []
    async for _ in service(busy_d0)._relayed(chunks(clock, handoff, [1.5, 1.6, 1.62, 1.64]), plan, job, handoff, 1.0):
        seen.append([stream for stream in busy_d0.on("d0") if stream.tpot_target == 0.05])
    # The first token is the prefill worker's: on d0 the stream starts with the second, 3 to go.
    assert seen[0] == [] and seen[1] == [DecodeStream(0.05, decoded_tokens=0, decode_seconds=0.0, tokens_left=2)]
    assert seen[3] == [DecodeStream(0.05, decoded_tokens=2, decode_seconds=pytest.approx(0.04), tokens_left=0)]
    assert handoff.prefill_stall is None  # p0 decodes nothing
    assert [stream.tpot_target for stream in busy_d0.on("d0")] == [0.1]  # gone with the request


async def test_a_prefill_that_failed_before_its_first_token_leaves_its_worker_quiet_again(busy_d0, monkeypatch):
    clock, plan = Clock(monkeypatch), Plan(PlanKind.LOCAL, "d0", None, estimate(stall=0.5))
    job = Job(prompt_token_ids=[1] * 300, sampling=wire.SamplingSpec(max_tokens=4), cache_salt="s")
    handoff = HandoffRecord(job.request_id)

    async def failing():
        clock.now = 1.2
        raise RuntimeError("worker gone")
        yield  # an async generator that fails before its first chunk

    with pytest.raises(RuntimeError):
        async for _ in service(busy_d0)._relayed(failing(), plan, job, handoff, 1.0):
            pass
    for at in (1.3, 1.32, 1.34, 1.36):  # steps after the failure are quiet ones
        busy_d0.token("d0", "running", 1, at)
    assert busy_d0.quiet_gap("d0") == pytest.approx(0.02)
    busy_d0.prefill_dispatched("d0", "next")
    busy_d0.token("d0", "running", 1, 1.86)  # beside the next prefill: not quiet
    assert busy_d0.prefilled("d0", "next", dispatched_at=1.36, now=1.86) == Stall(pytest.approx(0.5 - 0.02), 1)
