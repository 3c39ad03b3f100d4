"""OpenAI request schemas: what is accepted, what is refused, and the helpers the
serving path reads requests through."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from orchestrator.protocol import UNSUPPORTED_NEUTRAL, ChatCompletionRequest, ChatMessage, CompletionRequest

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Once upon", **fields})


def refused(build, expected_loc: tuple | None, expected_type: str | None = None, **fields: Any) -> dict:
    with pytest.raises(ValidationError) as info:
        build(**fields)
    errors = info.value.errors()
    if expected_loc is not None:
        assert any(tuple(e["loc"][:len(expected_loc)]) == expected_loc for e in errors), errors
    if expected_type is not None:
        assert any(e["type"] == expected_type for e in errors), errors
    return errors[0]


# ---------------------------------------------------------------- valid requests


def test_minimal_chat_request():
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": USER})
    assert request.model == "m"
    assert request.stream is False
    assert request.max_tokens is None and request.max_completion_tokens is None
    assert request.requested_max_tokens() is None
    assert request.temperature is None and request.top_p is None
    assert request.unsupported_parameter() is None
    assert request.stop_strings() == []
    assert request.include_usage() is False
    assert [m.as_template_message() for m in request.messages] == USER


def test_minimal_completion_request():
    request = CompletionRequest.model_validate({"model": "m", "prompt": "Once upon"})
    assert request.prompts() == ["Once upon"]
    assert request.requested_max_tokens() is None
    assert request.unsupported_parameter() is None


@pytest.mark.parametrize("fields", [
    {"max_tokens": 1},
    {"max_tokens": 4096, "temperature": 0.0, "top_p": 1.0},
    {"temperature": 2.0, "top_p": 0.01},
    {"seed": 0},
    {"seed": 2**63 - 1},
    {"stop": "\n"},
    {"stop": ["a", "b"]},
    {"stop": [str(i) for i in range(16)]},
    {"stream": True, "stream_options": {"include_usage": True}},
    {"user": "u" * 256},
    {"min_tokens": 3, "ignore_eos": True},
    {"max_completion_tokens": 5},
    {"store": False, "metadata": {"k": "v"}},
])
def test_valid_chat_fields(fields):
    request = chat(**fields)
    for name, value in fields.items():
        got = getattr(request, name)
        assert (got.model_dump(exclude_defaults=True) if hasattr(got, "model_dump") else got) == value


# ---------------------------------------------------------------- refused requests


@pytest.mark.parametrize("build", [chat, completion])
@pytest.mark.parametrize("fields, loc, kind", [
    ({"foo": 1}, ("foo",), "extra_forbidden"),
    ({"max_tokens": 0}, ("max_tokens",), "greater_than_equal"),
    ({"max_tokens": -5}, ("max_tokens",), "greater_than_equal"),
    ({"temperature": -0.1}, ("temperature",), "greater_than_equal"),
    ({"temperature": 2.01}, ("temperature",), "less_than_equal"),
    ({"top_p": 0}, ("top_p",), "greater_than"),
    ({"top_p": 1.5}, ("top_p",), "less_than_equal"),
    ({"seed": -1}, ("seed",), "greater_than_equal"),
    ({"seed": 2**63}, ("seed",), "less_than"),
    ({"min_tokens": -1}, ("min_tokens",), "greater_than_equal"),
    ({"model": ""}, ("model",), "string_too_short"),
    ({"user": "u" * 257}, ("user",), "string_too_long"),
    ({"stream_options": {"include_usage": True, "bogus": 1}}, ("stream_options", "bogus"), "extra_forbidden"),
])
def test_invalid_sampling_fields(build, fields, loc, kind):
    refused(build, loc, kind, **fields)


def test_model_is_required():
    refused(lambda: ChatCompletionRequest.model_validate({"messages": USER}), ("model",), "missing")
    refused(lambda: CompletionRequest.model_validate({"prompt": "x"}), ("model",), "missing")


@pytest.mark.parametrize("messages, loc, kind", [
    ([], ("messages",), "too_short"),
    (None, ("messages",), None),
    ([{"role": "tool", "content": "x"}], ("messages", 0, "role"), "literal_error"),
    ([{"role": "function", "content": "x"}], ("messages", 0, "role"), "literal_error"),
    ([{"role": "user"}], ("messages", 0, "content"), "missing"),
    ([{"content": "x"}], ("messages", 0, "role"), "missing"),
    ([{"role": "user", "content": "x", "extra": 1}], ("messages", 0, "extra"), "extra_forbidden"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     ("messages", 0, "content"), None),
    ([{"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]}], ("messages", 0, "content"), None),
])
def test_invalid_messages(messages, loc, kind):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    errors = info.value.errors()
    assert any(tuple(e["loc"][:len(loc)]) == loc for e in errors), errors
    if kind:
        assert any(e["type"] == kind for e in errors), errors


def test_messages_are_required():
    refused(lambda: ChatCompletionRequest.model_validate({"model": "m"}), ("messages",), "missing")


# ---------------------------------------------------------------- messages


@pytest.mark.parametrize("message, expected", [
    ({"role": "user", "content": "plain"}, {"role": "user", "content": "plain"}),
    ({"role": "system", "content": "rules"}, {"role": "system", "content": "rules"}),
    ({"role": "assistant", "content": "answer"}, {"role": "assistant", "content": "answer"}),
    ({"role": "developer", "content": "rules"}, {"role": "system", "content": "rules"}),
    ({"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]},
     {"role": "user", "content": "Hello, world"}),
    ({"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                                       {"type": "text", "text": "c"}]},
     {"role": "system", "content": "abc"}),
    ({"role": "user", "content": "named", "name": "bob"}, {"role": "user", "content": "named"}),
    ({"role": "user", "content": ""}, {"role": "user", "content": ""}),
])
def test_as_template_message(message, expected):
    assert ChatMessage.model_validate(message).as_template_message() == expected


def test_messages_keep_their_order():
    request = chat(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                             {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}])
    assert [m.as_template_message()["content"] for m in request.messages] == ["s", "u1", "a1", "u2"]


# ---------------------------------------------------------------- unsupported parameters


@pytest.mark.parametrize("build", [chat, completion])
@pytest.mark.parametrize("name, value", [
    ("n", 2),
    ("best_of", 3),
    ("logprobs", True),
    ("logprobs", 5),
    ("top_logprobs", 2),
    ("echo", True),
    ("suffix", "tail"),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("parallel_tool_calls", True),
    ("response_format", {"type": "json_object"}),
    ("logit_bias", {"50256": -100}),
    ("presence_penalty", 0.5),
    ("frequency_penalty", -1.0),
    ("audio", {"voice": "alloy"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
])
def test_unsupported_parameter_is_named(build, name, value):
    assert build(**{name: value}).unsupported_parameter() == name


@pytest.mark.parametrize("build", [chat, completion])
@pytest.mark.parametrize("name, value", [
    ("n", 1),
    ("n", None),
    ("best_of", 1),
    ("logprobs", False),
    ("logprobs", None),
    ("top_logprobs", 0),
    ("echo", False),
    ("suffix", ""),
    ("tools", []),
    ("tool_choice", "none"),
    ("functions", []),
    ("function_call", "none"),
    ("response_format", {"type": "text"}),
    ("logit_bias", {}),
    ("presence_penalty", 0),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0),
    ("modalities", ["text"]),
])
def test_neutral_values_are_accepted(build, name, value):
    assert build(**{name: value}).unsupported_parameter() is None


def test_every_unsupported_parameter_is_a_field():
    fields = set(ChatCompletionRequest.model_fields) & set(CompletionRequest.model_fields)
    assert set(UNSUPPORTED_NEUTRAL) <= fields
    # None is always neutral: omitting a parameter never refuses a request.
    assert all(None in neutral for neutral in UNSUPPORTED_NEUTRAL.values())


def test_first_unsupported_parameter_in_table_order():
    assert chat(presence_penalty=1.0, n=3).unsupported_parameter() == "n"


# ---------------------------------------------------------------- helpers


@pytest.mark.parametrize("stop, expected", [
    (None, []),
    ("\n", ["\n"]),
    ("", []),
    ([], []),
    (["a", "", "bc"], ["a", "bc"]),
    (["END", "END"], ["END", "END"]),
])
def test_stop_strings(stop, expected):
    assert chat(stop=stop).stop_strings() == expected
    assert completion(stop=stop).stop_strings() == expected


@pytest.mark.parametrize("fields, expected", [
    ({}, False),
    ({"stream": True}, False),
    ({"stream": True, "stream_options": {}}, False),
    ({"stream": True, "stream_options": {"include_usage": False}}, False),
    ({"stream": True, "stream_options": {"include_usage": True}}, True),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, False),
])
def test_include_usage(fields, expected):
    assert chat(**fields).include_usage() is expected
    assert completion(**fields).include_usage() is expected


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"max_tokens": 7}, 7),
    ({"max_completion_tokens": 9}, 9),
    ({"max_tokens": 7, "max_completion_tokens": 9}, 9),
    ({"max_tokens": 90, "max_completion_tokens": 3}, 3),
])
def test_chat_requested_max_tokens_prefers_max_completion_tokens(fields, expected):
    assert chat(**fields).requested_max_tokens() == expected


def test_max_completion_tokens_bounds():
    refused(chat, ("max_completion_tokens",), "greater_than_equal", max_completion_tokens=0)
    refused(completion, ("max_completion_tokens",), "extra_forbidden", max_completion_tokens=5)


def test_completion_requested_max_tokens():
    assert completion(max_tokens=12).requested_max_tokens() == 12
    assert completion().requested_max_tokens() is None


@pytest.mark.parametrize("prompt, expected", [
    ("Once upon", ["Once upon"]),
    (["a", "b c"], ["a", "b c"]),
    (["only"], ["only"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([0], [[0]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
    ([[5]], [[5]]),
])
def test_completion_prompts(prompt, expected):
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", ["", [], [""], ["a", ""], [[]], [[1], []]])
def test_empty_prompt_rejected(prompt):
    with pytest.raises(ValidationError, match="prompt must not be empty"):
        completion(prompt=prompt)


@pytest.mark.parametrize("prompt", [None, 5, [1, "a"], [[1], ["a"]], {"text": "x"}, [1.5]])
def test_malformed_prompt_rejected(prompt):
    with pytest.raises(ValidationError):
        completion(prompt=prompt)


def test_completion_prompt_is_required():
    refused(lambda: CompletionRequest.model_validate({"model": "m"}), ("prompt",), "missing")


def test_completion_rejects_chat_fields():
    refused(completion, ("messages",), "extra_forbidden", messages=USER)
    refused(chat, ("prompt",), "extra_forbidden", prompt="x")
