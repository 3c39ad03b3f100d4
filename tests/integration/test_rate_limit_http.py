"""Per-tenant rate limits over HTTP: a real orchestrator with synthetic-engine workers
(see tests/integration/test_worker_breaker.py). Tenant team-a has the orchestrator's limit (0.25/s,
burst 2); team-b's key sets its own, higher one. Once team-a has spent its burst its
completions get 429 in OpenAI's shape with Retry-After, streaming or not, while team-b is
served, team-a's other routes are not limited, and team-a is served again after waiting."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from foundation.model_prep import resolve_model
from testing.stack import SyntheticStack

MODEL = "SmolLM2-135M-Instruct"
RATE, BURST = 0.25, 2
KEYS = {"sk-limited-team-a": {"tenant": "team-a"},
        "sk-roomy-team-b": {"tenant": "team-b", "rate_limit": 50, "burst": 20}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rate_limit")
    keys = folder / "keys.json"
    keys.write_text(json.dumps({"keys": KEYS}))
    stack = SyntheticStack(resolve_model(None), folder / "stack.log",
                           ["--api-keys", str(keys), "--tenant-rate-limit", str(RATE), "--tenant-burst", str(BURST)],
                           token_seconds=0.001)
    try:
        stack.wait_healthy(300)  # /health is public and needs the one prefill and one decode worker
        yield stack
    finally:
        stack.stop()


def complete(stack, key: str, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Count to three.", "max_tokens": 2, "temperature": 0, "stream": stream}
    return httpx.post(stack.url + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"})


def rate_limited_total(stack, tenant: str) -> float:
    for line in httpx.get(stack.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(f'kvroute_rate_limited_total{{tenant="{tenant}"}}'):
            return float(line.split()[-1])
    return 0.0


def assert_rate_limited(response: httpx.Response) -> int:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert "rate limit" in error["message"]
    retry_after = int(response.headers["retry-after"])
    assert 1 <= retry_after <= 1 / RATE  # a whole token at most, rounded up
    return retry_after


def test_a_tenant_over_its_limit_waits_and_others_are_served(stack):
    key_a, key_b = "sk-limited-team-a", "sk-roomy-team-b"
    assert [complete(stack, key_a).status_code for _ in range(BURST)] == [200] * BURST
    assert_rate_limited(complete(stack, key_a))
    retry_after = assert_rate_limited(complete(stack, key_a, stream=True))

    # team-b's key has its own bucket (and a larger burst than the default would give it).
    assert [complete(stack, key_b).status_code for _ in range(8)] == [200] * 8
    headers = {"Authorization": f"Bearer {key_a}"}
    for _ in range(5):  # the routes that cost no engine time are not limited
        assert httpx.get(stack.url + "/v1/models", headers=headers).status_code == 200
        assert httpx.get(stack.url + "/v1/decisions", headers=headers).status_code == 200
        assert httpx.get(stack.url + "/health").status_code == 200
        assert httpx.get(stack.url + "/metrics").status_code == 200
    assert rate_limited_total(stack, "team-a") == 2
    assert rate_limited_total(stack, "team-b") == 0

    time.sleep(retry_after)
    served = complete(stack, key_a)
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["finish_reason"] == "length"
    assert rate_limited_total(stack, "team-a") == 2
