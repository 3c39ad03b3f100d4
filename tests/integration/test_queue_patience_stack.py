"""A busy worker is waited for, a hung one is not: real processes (an orchestrator and
synthetic-engine workers, see ``testing.synthetic_worker``) with a worker timeout of 1 s
and a circuit breaker that opens at the first failure. Each worker takes about 3 s to
compute the prompt, in engine steps of 0.1 s, so every wait for a token times out at
least twice: the request still completes, on the workers it was placed on, and nobody's
breaker opens. A prefill worker whose engine stops stepping (SIGUSR2) fails its request
after about two timeouts; that failure counts, and the request moves to the other one."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from foundation.model_prep import resolve_model
from testing.stack import running_synthetic_stack
from tests.cluster import metric_at

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "word " * 200  # about 200 tokens: 3 s at 15 ms a token
SECONDS_PER_PROMPT_TOKEN = 0.015


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_synthetic_stack(resolve_model(None), tmp_path_factory.mktemp("logs") / "stack.log",
                                 ["--policy", "round_robin", "--worker-timeout-seconds", "1",
                                  "--breaker-failure-threshold", "1", "--breaker-cooldown-seconds", "600"],
                                 token_seconds=0.01, roles=("prefill", "prefill", "decode"),
                                 worker_args=("--prefill-seconds-per-token", str(SECONDS_PER_PROMPT_TOKEN))) as stack:
        yield stack


def complete(stack) -> tuple[dict, float]:
    started = time.monotonic()
    reply = httpx.post(stack.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json(), time.monotonic() - started


def metric(stack, line_start: str) -> float:
    return metric_at(stack.url, line_start)


def test_a_busy_worker_keeps_its_requests_and_a_hung_one_loses_them(stack):
    body, seconds = complete(stack)
    assert body["usage"]["completion_tokens"] == 4
    assert seconds > 5  # prefill and decode each took longer than the 1 s timeout...
    assert metric(stack, "kvroute_request_migrations_total") == 0  # ...and neither was given up on
    assert metric(stack, "kvroute_worker_failures_total") == 0
    for worker in ("prefill-0", "prefill-1", "decode-0"):
        assert metric(stack, f'kvroute_worker_breaker_state{{worker="{worker}"}}') == 0
    log = stack.log_path.read_text()
    assert "it is still queued there and the worker is working, so the request keeps its place" in log

    stack.worker_processes["prefill-0"].send_signal(signal.SIGUSR2)  # its engine stops stepping
    time.sleep(0.5)
    for _ in range(2):  # round robin places one of them on prefill-0, which times out
        body, _ = complete(stack)
        assert body["usage"]["completion_tokens"] == 4
    assert metric(stack, 'kvroute_request_migrations_total{role="prefill"}') == 1
    assert metric(stack, 'kvroute_worker_breaker_state{worker="prefill-0"}') == 2  # open
    assert metric(stack, 'kvroute_worker_breaker_state{worker="prefill-1"}') == 0
    assert metric(stack, 'kvroute_worker_breaker_state{worker="decode-0"}') == 0
    stack.worker_processes["prefill-0"].send_signal(signal.SIGUSR2)
