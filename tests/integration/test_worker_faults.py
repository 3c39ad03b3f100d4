"""Worker faults through the OpenAI API, with real processes: an orchestrator and workers
whose engines are synthetic (``testing.synthetic_worker``: the real RPC server and
heartbeats, tokens a pure function of the context, like greedy decoding), killed with
SIGKILL mid-stream. Only the engine is synthetic; sockets, processes and the orchestrator
are the real ones."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from foundation.model_prep import resolve_model
from testing.stack import running_synthetic_stack
from tests.integration.faults import MAX_TOKENS, kill, stream

ROLES = ("prefill", "decode", "decode")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_synthetic_stack(resolve_model(None), tmp_path_factory.mktemp("logs") / "stack.log",
                                 ["--policy", "least_loaded", "--heartbeat-timeout-seconds", "30"],
                                 token_seconds=0.05, roles=ROLES) as stack:
        yield stack


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused",
                         max_retries=0)  # strict validation rejects streamed completion chunks (finish_reason None)


def decode_worker_of(stack, response_id: str) -> str:
    records = httpx.get(f"{stack.url}/v1/decisions/{response_id}", timeout=5).json()["data"]
    return records[0]["chosen"]["decode_worker"]


def test_decode_worker_killed_mid_stream_the_stream_continues_unchanged(stack, client):
    prompt = "A worker may die at any moment; the client should never notice."
    reference = "".join(chunk.choices[0].text for chunk in stream(client, prompt) if chunk.choices)

    text, usage, started = [], None, time.monotonic()
    events = stream(client, prompt)
    for number, chunk in enumerate(events):
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
        if number == 5:
            kill(stack, decode_worker_of(stack, chunk.id))
    elapsed = time.monotonic() - started

    assert "".join(text) == reference  # no token lost, none repeated
    assert usage.completion_tokens == MAX_TOKENS
    # The dead connection is seen at once, not after the 30 s heartbeat timeout.
    assert elapsed < 15, elapsed
    metrics = httpx.get(stack.url + "/metrics", timeout=5).text
    assert 'kvroute_request_migrations_total{role="decode"} 1.0' in metrics


def test_with_no_decode_worker_left_the_stream_ends_with_an_error_event(stack, client):
    live = [w["worker_id"] for w in httpx.get(stack.url + "/admin/workers", timeout=5).json()["workers"]
            if w["role"] == "decode" and stack.worker_processes[w["worker_id"]].poll() is None]
    assert len(live) == 1
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="worker"):
        for number, _ in enumerate(stream(client, "The last decode worker goes away.")):
            if number == 3:
                kill(stack, live[0])
    assert time.monotonic() - started < 15  # an error event, then the end: never a hang
    assert httpx.get(stack.url + "/health", timeout=5).status_code in (200, 503)
