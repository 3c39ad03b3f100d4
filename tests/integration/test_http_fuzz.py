"""Property-based fuzzing of every HTTP endpoint: whatever a client sends, the answer is
never a 5xx, a 4xx is OpenAI-shaped, and the server still serves a good request after.

Runs against a real orchestrator with synthetic-engine workers (real processes and
sockets, no model), so hundreds of requests take seconds.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foundation.model_prep import resolve_model
from testing.stack import running_synthetic_stack

MODEL = "SmolLM2-135M-Instruct"
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_synthetic_stack(resolve_model(None), tmp_path_factory.mktemp("logs") / "stack.log",
                                 ["--policy", "cache_aware", "--max-model-len", "2048"], token_seconds=0.0005,
                                 roles=("prefill", "decode")) as stack, \
            httpx.Client(base_url=stack.url, timeout=30) as client:
        yield client


scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) \
    | st.text(max_size=40)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
token_ids = st.lists(st.integers(-5, 60000), max_size=20)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                                           "content": st.text(max_size=60) | values}), max_size=3)
common = {"model": st.sampled_from([MODEL, "", "gpt-4"]) | values,
          "max_tokens": st.integers(-3, 40) | st.integers(10**6, 10**20) | values,
          "max_completion_tokens": st.integers(-3, 40) | values,
          "temperature": st.floats(-1, 3, allow_nan=False) | values,
          "top_p": st.floats(-1, 2, allow_nan=False) | values, "seed": st.integers(-5, 2**64) | values,
          "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=6) | values,
          "stream": st.booleans() | values, "stream_options": st.fixed_dictionaries({"include_usage": values}),
          "min_tokens": st.integers(-3, 60) | values, "ignore_eos": st.booleans() | values,
          "n": st.integers(0, 3), "logprobs": values, "tools": values, "user": st.text(max_size=300),
          "unknown_field": values}


def bodies(required: dict) -> st.SearchStrategy:
    optional = st.fixed_dictionaries({}, optional=common)
    return st.tuples(st.fixed_dictionaries({}, optional=required), optional).map(lambda parts: {**parts[1],
                                                                                                **parts[0]})


completion_bodies = bodies({"prompt": st.text(max_size=80) | token_ids | st.lists(token_ids, max_size=3)
                            | st.lists(st.text(max_size=20), max_size=3) | values, "model": st.just(MODEL)})
chat_bodies = bodies({"messages": messages | values, "model": st.just(MODEL)})


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: "):])
                assert "error" not in event or event["error"]["message"], event


@FUZZ
@given(body=completion_bodies)
def test_completions_never_fail_with_5xx(server, body):
    check(server.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"}))


@FUZZ
@given(body=chat_bodies)
def test_chat_completions_never_fail_with_5xx(server, body):
    check(server.post("/v1/chat/completions", content=json.dumps(body),
                      headers={"content-type": "application/json"}))


@FUZZ
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       content_type=st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded"]))
def test_raw_bodies_get_4xx(server, raw, path, content_type):
    check(server.post(path, content=raw, headers={"content-type": content_type} if content_type else {}))


@FUZZ
@given(path=st.sampled_from(["/v1/models", "/health", "/metrics", "/v1/decisions", "/admin/workers"])
       | st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_/%.", max_size=30).map(lambda p: "/" + p)
       | st.text(max_size=20).map(lambda p: "/v1/decisions/" + quote(p, safe="")),
       query=st.dictionaries(st.sampled_from(["limit", "x", ""]), st.text(max_size=8), max_size=2),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
def test_other_endpoints_never_fail_with_5xx(server, path, query, method):
    response = server.request(method, path, params=query)
    assert response.status_code < 500, (method, path, response.status_code, response.text[:300])
    if response.status_code >= 400 and path != "/health":
        assert response.json()["error"]["message"]


def test_still_serving_after_the_fuzzing(server):
    response = server.post("/v1/completions", json={"model": MODEL, "prompt": "still here?", "max_tokens": 5})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 5
