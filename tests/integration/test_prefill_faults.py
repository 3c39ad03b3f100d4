"""A prefill worker killed while it prefills, through the OpenAI API, with real processes
(an orchestrator and synthetic-engine workers, as in ``test_worker_faults``): the request
moves to the other prefill worker, the client sees no error and an unchanged output, and
the move is counted."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from foundation.model_prep import resolve_model
from testing.stack import running_synthetic_stack
from tests.integration.faults import MAX_TOKENS, kill, stream

ROLES = ("prefill", "prefill", "decode")
PREFILL_SECONDS_PER_TOKEN = 0.02  # a prompt of ~100 tokens takes ~2 s: time to kill its worker


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_synthetic_stack(resolve_model(None), tmp_path_factory.mktemp("logs") / "stack.log",
                                 ["--policy", "least_loaded", "--heartbeat-timeout-seconds", "30"],
                                 token_seconds=0.01, roles=ROLES,
                                 worker_args=("--prefill-seconds-per-token", str(PREFILL_SECONDS_PER_TOKEN))) as stack:
        yield stack


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def prefilling_worker(stack, after_response: str, timeout: float = 10) -> str:
    """The prefill worker of the first request planned after ``after_response`` (a record
    exists from the plan on, long before the response's first event)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = httpx.get(f"{stack.url}/v1/decisions", params={"limit": 1}, timeout=5).json()["data"]
        if records and records[0]["response_id"] != after_response:
            return records[0]["chosen"]["prefill_worker"]
        time.sleep(0.05)
    raise AssertionError("the request was never planned")


def test_prefill_worker_killed_while_prefilling_the_request_moves_and_the_client_sees_nothing(stack, client):
    prompt = " ".join(["The prefill worker of this prompt dies before its first token."] * 8)
    reference, reference_id = [], None
    for chunk in stream(client, prompt):
        reference_id = chunk.id
        if chunk.choices:
            reference.append(chunk.choices[0].text)

    def consume() -> tuple[list[str], object]:
        text, usage = [], None
        for chunk in stream(client, prompt):
            if chunk.choices:
                text.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
        return text, usage

    started = time.monotonic()
    # The stream's response starts only once the first token exists (admission comes
    # first), so the request runs in a thread while this one kills its prefill worker.
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(consume)
        victim = prefilling_worker(stack, reference_id)
        kill(stack, victim)
        text, usage = running.result(timeout=60)

    assert "".join(text) == "".join(reference)
    assert usage.completion_tokens == MAX_TOKENS
    assert time.monotonic() - started < 20  # the dead connection is seen at once, not at the heartbeat timeout
    metrics = httpx.get(stack.url + "/metrics", timeout=5).text
    assert 'kvroute_request_migrations_total{role="prefill"} 1.0' in metrics
    survivors = [w["worker_id"] for w in httpx.get(stack.url + "/admin/workers", timeout=5).json()["workers"]
                 if w["role"] == "prefill"]
    assert victim not in survivors and len(survivors) == 1
