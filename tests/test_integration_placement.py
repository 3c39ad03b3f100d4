"""Cache-aware placement on real engines: two prefill workers, one decode worker.

A request whose long prefix is already resident goes where it is resident, reports
``cached_tokens > 0``, and its decision record says why; the same prompt from another
tenant matches nothing.
"""

from __future__ import annotations

import time

import httpx
import pytest

from kvroute.model_prep import default_cache_dir
from kvroute.bench.stack import Stack

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"sk-tenant-a": {"tenant": "team-a"}, "sk-tenant-b": {"tenant": "team-b"}}
SHARED = "You are the assistant of the kvroute repository. Repository map follows. " + " ".join(
    f"src/module_{i}.py defines class Component{i} and function handle_{i}." for i in range(60))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("placement")
    keys = folder / "keys.json"
    keys.write_text(__import__("json").dumps({"keys": KEYS}))
    stack = Stack(default_cache_dir(), folder / "serve.log",
                  ["--dtype", "float32", "--kv-cache-gib", "0.5", "--max-model-len", "4096",
                   "--prefill-workers", "2", "--decode-workers", "1", "--api-keys", str(keys),
                   "--allow-policy-override"])
    try:
        stack.wait_healthy(900)
        yield stack
    finally:
        stack.stop()


def ask(stack: Stack, key: str, question: str, policy: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} | ({"X-KVRoute-Policy": policy} if policy else {})
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SHARED}, {"role": "user", "content": question}]}
    response = httpx.post(stack.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def decision(stack: Stack, key: str, response_id: str) -> dict:
    reply = httpx.get(f"{stack.url}/v1/decisions/{response_id}", headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 200, reply.text
    return reply.json()["data"][0]


def wait_indexed(stack: Stack, key: str, minimum_blocks: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {key}"}
    while sum(w["index_blocks"] for w in stack.workers(headers)) < minimum_blocks:
        assert time.monotonic() < deadline, "KV events never reached the index"
        time.sleep(0.2)


def test_api_keys_are_required(stack):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(stack.url + "/v1/chat/completions", json=body).status_code == 401
    wrong = httpx.post(stack.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(stack.url + "/health").status_code == 200


def test_warm_prefix_is_reused_and_explained(stack):
    reset = httpx.post(stack.url + "/admin/reset-cache", headers={"Authorization": "Bearer sk-tenant-a"})
    assert reset.status_code == 200, reset.text
    first = ask(stack, "sk-tenant-a", "Which module defines Component7?")
    assert first["usage"]["prompt_tokens"] > 3 * 128
    wait_indexed(stack, "sk-tenant-a", minimum_blocks=3)

    second = ask(stack, "sk-tenant-a", "Which function does module 12 define?")
    record = decision(stack, "sk-tenant-a", second["id"])
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert record["predicted_reused_tokens"] > 0
    assert record["actual"]["reused_tokens"] == second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert "holds" in record["reason"] and record["chosen"]["estimate"]["reused_tokens"] > 0


def test_other_tenant_matches_nothing(stack):
    ask(stack, "sk-tenant-a", "Which module defines Component3?")
    wait_indexed(stack, "sk-tenant-a", minimum_blocks=3)
    other = ask(stack, "sk-tenant-b", "Which module defines Component3?")
    record = decision(stack, "sk-tenant-b", other["id"])
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert record["predicted_reused_tokens"] == 0
    assert all(plan["estimate"]["reused_tokens"] == 0 for plan in record["alternatives"])


def test_policy_override_header(stack):
    response = ask(stack, "sk-tenant-a", "How many modules are listed?", policy="round_robin")
    assert decision(stack, "sk-tenant-a", response["id"])["policy"] == "round_robin"
    bad = httpx.post(stack.url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-tenant-a",
                                                                  "X-KVRoute-Policy": "fastest"},
                     json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-KVRoute-Policy"
