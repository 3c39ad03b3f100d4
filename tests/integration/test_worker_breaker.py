"""The circuit breaker with real processes: an orchestrator and synthetic-engine workers
(see tests/integration/test_worker_faults.py). A decode worker made to fail every request (SIGUSR1,
``testing.synthetic_worker``'s failure injection) stays registered and heartbeating; its
requests move to the other decode worker, its breaker opens after two failures and no
more requests are placed on it; once healthy again and past the cool-down, a probe
request succeeds on it and it is back in rotation."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from foundation.model_prep import resolve_model
from testing.stack import running_synthetic_stack
from tests.cluster import metric_at

MODEL = "SmolLM2-135M-Instruct"
ROLES = ("prefill", "decode", "decode")
FLAKY = "decode-1"
# Long enough for the eight requests after the breaker opens to finish within it on a loaded
# machine (at 3 s a probe went to the flaky worker mid-loop under a load average of 7).
COOLDOWN_SECONDS = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_synthetic_stack(resolve_model(None), tmp_path_factory.mktemp("logs") / "stack.log",
                                 ["--policy", "round_robin", "--heartbeat-timeout-seconds", "30",
                                  "--breaker-failure-threshold", "2",
                                  "--breaker-cooldown-seconds", str(COOLDOWN_SECONDS)],
                                 token_seconds=0.01, roles=ROLES) as stack:
        yield stack


def complete(stack, number: int) -> None:
    """One completion, which must succeed (moved to another worker if need be)."""
    reply = httpx.post(stack.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": f"Request number {number}.", "max_tokens": 4,
                             "temperature": 0})
    assert reply.status_code == 200, reply.text


def metric(stack, line_start: str) -> float:
    return metric_at(stack.url, line_start)


def breaker_state(stack) -> float:
    return metric(stack, f'kvroute_worker_breaker_state{{worker="{FLAKY}"}}')


def migrations(stack) -> float:
    return metric(stack, 'kvroute_request_migrations_total{role="decode"}')


def placed_on_flaky(stack) -> float:
    """Requests whose first placement chose the flaky worker (continuations are not counted)."""
    return metric(stack, f'kvroute_worker_selected_total{{role="decode",worker="{FLAKY}"}}')


def test_a_failing_worker_leaves_the_rotation_and_returns_once_healthy(stack):
    stack.worker_processes[FLAKY].send_signal(signal.SIGUSR1)  # start failing
    time.sleep(0.5)
    for number in range(8):
        complete(stack, number)
    # Round robin tried it twice, both requests moved to decode-0; then its breaker opened
    # and the six requests after that went to decode-0 directly.
    assert placed_on_flaky(stack) == 2
    assert migrations(stack) == 2
    assert breaker_state(stack) == 2  # open

    stack.worker_processes[FLAKY].send_signal(signal.SIGUSR1)  # healthy again
    time.sleep(COOLDOWN_SECONDS + 0.5)
    assert breaker_state(stack) == 1  # half-open: a probe may go
    for number in range(8, 12):
        complete(stack, number)
    assert placed_on_flaky(stack) == 4  # the probe, then round robin alternating again
    assert migrations(stack) == 2  # none of them failed
    assert breaker_state(stack) == 0  # closed: back in rotation
    log = stack.log_path.read_text()
    assert f"circuit breaker of worker {FLAKY} opened" in log and f"circuit breaker of worker {FLAKY} closed" in log
