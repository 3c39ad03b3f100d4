"""Request traces through a real OTLP exporter: an orchestrator and synthetic prefill and decode
workers (the real RPC server, whose spans these are; the decode worker acts out its KV pull),
each started with ``--otlp-endpoint`` pointing at a receiver the test runs on loopback. One
disaggregated request must leave one trace holding the orchestrator's API and placement spans
and both workers' prefill, decode and KV-pull spans, parented in that order, with their
GenAI and kvroute attributes; a client's own ``traceparent`` must carry through all of them."""

from __future__ import annotations

import json

import httpx
import pytest

from foundation.model_prep import resolve_model
from testing.stack import running_synthetic_stack
from testing.synthetic_worker import BLOCK_SIZE, BYTES_PER_BLOCK
from tests.otlp_receiver import ReceivedSpan, running_otlp_receiver, trace_of

MODEL = "SmolLM2-135M-Instruct"  # the default model's served name: its folder's
PROMPT = "Explain how a prefix cache saves work for requests that share a system prompt. " * 20
MAX_TOKENS = 6
CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
WORKER_SPANS = {("kvroute-prefill-worker", "kvroute.prefill"), ("kvroute-decode-worker", "kvroute.decode"),
                ("kvroute-decode-worker", "kvroute.kv_pull")}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """The receiver, and a stack exporting to it, its spans batched for 0.1 s rather than 5."""
    folder = tmp_path_factory.mktemp("tracing")
    with pytest.MonkeyPatch.context() as env, running_otlp_receiver() as receiver:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the SDK's own setting, read by every process started
        with running_synthetic_stack(resolve_model(None), folder / "stack.log",
                                     ["--otlp-endpoint", receiver.url, "--allow-policy-override"],
                                     token_seconds=0.002, roles=("prefill", "decode"),
                                     worker_args=("--otlp-endpoint", receiver.url, "--pull-bytes-per-second", "2e9")
                                     ) as stack:
            yield stack, receiver


def complete(stack, headers: dict | None = None, stream: bool = False) -> dict:
    """A completion the baseline policy splits (DISAGG), so the KV moves from prefill-0 to decode-0."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    response = httpx.post(stack.url + "/v1/completions", json=body, timeout=60,
                          headers={"X-KVRoute-Policy": "least_loaded", **(headers or {})})
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    return {"id": events[0]["id"], "usage": events[-1]["usage"]}


def complete_trace(spans: list[ReceivedSpan], response_id: str, api_name: str) -> bool:
    names = set(trace_of(spans, response_id))
    return {("kvroute-orchestrator", api_name), ("kvroute-orchestrator", "kvroute.placement")} | WORKER_SPANS <= names


def test_one_trace_holds_the_orchestrators_and_both_workers_spans(traced):
    stack, receiver = traced
    reply = complete(stack)
    api_name = f"text_completion {MODEL}"
    trace = trace_of(receiver.wait_for(lambda spans: complete_trace(spans, reply["id"], api_name), 20), reply["id"])
    api, placement = trace["kvroute-orchestrator", api_name], trace["kvroute-orchestrator", "kvroute.placement"]
    prefill = trace["kvroute-prefill-worker", "kvroute.prefill"]
    decode, pull = trace["kvroute-decode-worker", "kvroute.decode"], trace["kvroute-decode-worker", "kvroute.kv_pull"]

    assert api.kind == "SERVER" and api.parent_span_id == ""
    assert placement.parent_span_id == prefill.parent_span_id == decode.parent_span_id == api.span_id
    assert pull.parent_span_id == decode.span_id
    assert (prefill.resource["service.instance.id"], decode.resource["service.instance.id"]) == ("prefill-0",
                                                                                                   "decode-0")
    usage = reply["usage"]
    assert {key: api.attributes[key] for key in ("gen_ai.operation.name", "gen_ai.request.model",
                                                 "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
                                                 "gen_ai.usage.cache_read.input_tokens")} == {
        "gen_ai.operation.name": "text_completion", "gen_ai.request.model": reply["model"],
        "gen_ai.usage.input_tokens": usage["prompt_tokens"], "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "gen_ai.usage.cache_read.input_tokens": usage["prompt_tokens_details"]["cached_tokens"]}
    assert api.status_code != 2

    (record,) = httpx.get(f"{stack.url}/v1/decisions/{reply['id']}", timeout=10).json()["data"]
    chosen = record["chosen"]
    assert (chosen["kind"], chosen["prefill_worker"], chosen["decode_worker"]) == ("disagg", "prefill-0", "decode-0")
    assert {key: placement.attributes[key] for key in ("kvroute.plan.kind", "kvroute.plan.prefill_worker",
                                                       "kvroute.plan.decode_worker", "kvroute.policy",
                                                       "kvroute.alternatives", "kvroute.estimate.ttft_seconds",
                                                       "kvroute.estimate.transfer_bytes")} == {
        "kvroute.plan.kind": "disagg", "kvroute.plan.prefill_worker": "prefill-0",
        "kvroute.plan.decode_worker": "decode-0", "kvroute.policy": "least_loaded",
        "kvroute.alternatives": len(record["alternatives"]),
        "kvroute.estimate.ttft_seconds": chosen["estimate"]["ttft"],
        "kvroute.estimate.transfer_bytes": chosen["estimate"]["transfer_bytes"]}

    prompt_tokens = usage["prompt_tokens"]
    assert (prefill.attributes["gen_ai.usage.input_tokens"], prefill.attributes["gen_ai.usage.output_tokens"]) == (
        prompt_tokens, 1)
    assert (decode.attributes["gen_ai.usage.input_tokens"], decode.attributes["gen_ai.usage.output_tokens"]) == (
        prompt_tokens + 1, MAX_TOKENS - 1)
    assert decode.attributes["gen_ai.request.model"] == reply["model"]
    assert pull.attributes["kvroute.transfer.bytes"] == -(-prompt_tokens // BLOCK_SIZE) * BYTES_PER_BLOCK
    assert pull.attributes["kvroute.transfer.ok"] is True and pull.attributes["kvroute.transfer.seconds"] > 0
    # The pull lies inside the decode that made it, as the connector timed it.
    assert decode.start_ns <= pull.start_ns < pull.end_ns <= decode.end_ns
    # The decode starts once the prefill's first token reached the orchestrator (the prefill
    # worker's span may end a moment later, after it sent that token).
    assert prefill.start_ns + prefill.attributes["kvroute.first_token_seconds"] * 1e9 <= decode.start_ns


def test_a_clients_traceparent_carries_through_a_streamed_request(traced):
    stack, receiver = traced
    reply = complete(stack, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}, stream=True)
    api_name = f"text_completion {MODEL}"
    trace = trace_of(receiver.wait_for(lambda spans: complete_trace(spans, reply["id"], api_name), 20), reply["id"])
    api = trace["kvroute-orchestrator", api_name]
    assert {span.trace_id for span in trace.values()} == {CLIENT_TRACE}
    assert api.parent_span_id == CLIENT_SPAN
    assert api.attributes["gen_ai.usage.output_tokens"] == reply["usage"]["completion_tokens"] == MAX_TOKENS
