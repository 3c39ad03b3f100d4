"""The spans one request leaves: the worker's prefill or decode with its KV pull
(worker.request_spans), and the orchestrator's API call and placement (orchestrator.request_tracing)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from foundation import tracing, wire
from orchestrator.planner.views import Decision, Estimate, Plan, PlanKind
from orchestrator.request_tracing import ApiCall, describe, placement_span
from orchestrator.service import Job, Outcome
from worker.request_spans import UNTRACED, request_spans


@pytest.fixture
def exported():
    exporter = InMemorySpanExporter()
    tracing.install(exporter, "kvroute-decode-worker", batch=False)
    yield exporter
    tracing.shutdown()


def by_name(exporter) -> dict:
    return {span.name: span for span in exporter.get_finished_spans()}


def test_a_decode_with_a_pull_leaves_a_decode_span_and_its_pull_at_the_connectors_times(exported):
    parent = tracing.start_span("chat m", kind=tracing.SERVER)
    source = wire.PullSource(handle="h" * 32, address="tcp://10.0.0.1:5000", num_tokens=300, block_size=128)
    request = wire.GenerateRequest(request_id="r1", prompt_token_ids=list(range(301)), pull_from=source,
                                   sampling=wire.SamplingSpec(max_tokens=7), trace_context=tracing.carrier(parent))
    spans = request_spans(request, "/models/SmolLM2-135M-Instruct")
    pull = wire.PullRecord("r1-9383ce2a", source.address, num_bytes=3 * 5_898_240, seconds=0.25, ok=True,
                           started_at=1_700_000_000.5)
    spans.observe(wire.GenerateChunk(request_id="r1", token_ids=[5], transfer=pull))
    spans.observe(wire.GenerateChunk(request_id="r1", token_ids=[6, 7], finished=True, finish_reason="length",
                                     num_prompt_tokens=301, num_cached_tokens=256))
    spans.finish()
    tracing.end_span(parent)

    spans = by_name(exported)
    decode, kv_pull, api = spans["kvroute.decode"], spans["kvroute.kv_pull"], spans["chat m"]
    assert decode.kind is SpanKind.SERVER and decode.parent.span_id == api.context.span_id
    assert {decode.context.trace_id, kv_pull.context.trace_id} == {api.context.trace_id}
    assert kv_pull.parent.span_id == decode.context.span_id
    assert (kv_pull.start_time, kv_pull.end_time) == (1_700_000_000_500_000_000, 1_700_000_000_750_000_000)
    assert dict(kv_pull.attributes) == {"kvroute.transfer.bytes": 3 * 5_898_240, "kvroute.transfer.seconds": 0.25,
                                        "kvroute.transfer.source": source.address, "kvroute.transfer.ok": True}
    attributes = dict(decode.attributes)
    assert attributes.pop("kvroute.first_token_seconds") >= 0
    assert attributes == {
        "gen_ai.operation.name": "text_completion", "gen_ai.request.model": "SmolLM2-135M-Instruct",
        "gen_ai.request.max_tokens": 7, "gen_ai.usage.input_tokens": 301, "gen_ai.usage.output_tokens": 3,
        "gen_ai.usage.cache_read.input_tokens": 256, "gen_ai.response.finish_reasons": ("length",),
        "kvroute.request_id": "r1", "kvroute.pull_from": source.address}
    assert decode.status.status_code is StatusCode.UNSET


def test_a_prefill_that_fails_is_a_failed_prefill_span_and_a_failed_pull_a_failed_pull_span(exported):
    prefill = request_spans(wire.GenerateRequest(request_id="p", prompt_token_ids=[1, 2], hold_blocks=True), "m")
    prefill.fail(RuntimeError("engine died"))
    prefill.finish()
    decode = request_spans(wire.GenerateRequest(request_id="d", prompt_token_ids=[1, 2]), "m")
    decode.observe(wire.GenerateChunk(request_id="d", token_ids=[3], transfer=wire.PullRecord("d", "a", 0, 0.1, False)))
    decode.fail("caller_gone")
    decode.finish()
    spans = by_name(exported)
    assert spans["kvroute.prefill"].parent is None  # no context came with it: a trace of its own
    assert spans["kvroute.prefill"].attributes["error.type"] == "RuntimeError"
    assert spans["kvroute.kv_pull"].attributes["error.type"] == "pull_failed"
    assert spans["kvroute.decode"].attributes["error.type"] == "caller_gone"
    assert spans["kvroute.decode"].status.status_code is StatusCode.ERROR


def test_untraced_while_tracing_is_off():
    tracing.shutdown()
    assert request_spans(wire.GenerateRequest(request_id="r", prompt_token_ids=[1]), "m") is UNTRACED
    job = Job(prompt_token_ids=[1], sampling=wire.SamplingSpec(), cache_salt="s")
    call = ApiCall("chat", "/v1/chat/completions", "m", [job], {})
    assert job.trace_span is tracing.NO_SPAN
    with call.until_done([Outcome()]), placement_span(job.trace_span, job.request_id) as span:
        describe(span, Decision("cache_aware", None))


PLAN = Plan(PlanKind.DISAGG, decode_worker="decode-0", prefill_worker="prefill-0",
            estimate=Estimate(queue_wait=0.1, prefill=0.5, transfer=0.02, ttft=0.6, gap=0.03, reused_tokens=256,
                              transfer_bytes=1 << 20))


def test_the_api_call_parents_its_placement_and_holds_the_usage(exported):
    jobs = [Job(prompt_token_ids=list(range(n)), sampling=wire.SamplingSpec(max_tokens=8), cache_salt="s",
                tenant="acme", response_id="cmpl-1") for n in (300, 40)]
    client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    call = ApiCall("text_completion", "/v1/completions", "SmolLM2", jobs, {"traceparent": client})
    outcomes = [Outcome(completion_tokens=8, cached_tokens=256, finish_reason="length"),
                Outcome(completion_tokens=2, finish_reason="stop")]
    with call.until_done(outcomes):
        local = Plan(PlanKind.LOCAL, decode_worker="decode-0", prefill_worker=None, feasible=False,
                     infeasible_reason="full")
        with placement_span(jobs[0].trace_span, jobs[0].request_id) as span:
            describe(span, Decision("cache_aware", PLAN, (PLAN, local), reason="least TTFT"))

    spans = by_name(exported)
    api, placement = spans["text_completion SmolLM2"], spans["kvroute.placement"]
    assert api.kind is SpanKind.SERVER and f"{api.parent.span_id:016x}" == "b7ad6b7169203331"
    assert placement.parent.span_id == api.context.span_id
    assert {key: api.attributes[key] for key in api.attributes if key.startswith("gen_ai.")} == {
        "gen_ai.operation.name": "text_completion", "gen_ai.request.model": "SmolLM2",
        "gen_ai.request.max_tokens": 8, "gen_ai.response.id": "cmpl-1", "gen_ai.usage.input_tokens": 340,
        "gen_ai.usage.output_tokens": 10, "gen_ai.usage.cache_read.input_tokens": 256,
        "gen_ai.response.finish_reasons": ("length", "stop")}
    assert api.attributes["kvroute.tenant"] == "acme" and api.attributes["http.route"] == "/v1/completions"
    assert dict(placement.attributes) == {
        "kvroute.request_id": jobs[0].request_id, "kvroute.policy": "cache_aware", "kvroute.reason": "least TTFT",
        "kvroute.alternatives": 1, "kvroute.alternatives.feasible": 0, "kvroute.plan.kind": "disagg",
        "kvroute.plan.decode_worker": "decode-0", "kvroute.plan.prefill_worker": "prefill-0",
        "kvroute.estimate.ttft_seconds": 0.6, "kvroute.estimate.gap_seconds": 0.03,
        "kvroute.estimate.queue_wait_seconds": 0.1, "kvroute.estimate.prefill_seconds": 0.5,
        "kvroute.estimate.transfer_seconds": 0.02, "kvroute.estimate.transfer_bytes": 1 << 20,
        "kvroute.estimate.reused_tokens": 256}


def test_a_client_that_leaves_mid_stream_fails_the_api_span_as_gone(exported):
    job = Job(prompt_token_ids=[1], sampling=wire.SamplingSpec(), cache_salt="s")
    call = ApiCall("chat", "/v1/chat/completions", "m", [job], {})
    with pytest.raises(GeneratorExit), call.until_done([Outcome()]):
        raise GeneratorExit
    (api,) = exported.get_finished_spans()
    assert api.attributes["error.type"] == "client_gone"
    assert api.attributes["gen_ai.response.finish_reasons"] == ("none",)
