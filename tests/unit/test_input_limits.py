"""The bounds on prompts and stop strings (orchestrator.input_limits) and their settings.
Over HTTP, with a real server: tests/integration/test_http_security.py."""

from __future__ import annotations

import threading

import pytest

from orchestrator.api import tokenize_off_loop_if_large
from orchestrator.errors import APIError
from orchestrator.input_limits import InputLimits
from orchestrator.settings import OrchestratorSettings

LIMITS = InputLimits(max_prompts_per_request=16, max_stop_sequences=4, max_stop_length=256)


@pytest.mark.parametrize("stops", [[], ["\n"], ["a", "b", "c", "d"], ["x" * 256] * 4])
def test_stops_within_the_limits_pass(stops):
    LIMITS.check_stops(stops)


@pytest.mark.parametrize("stops, code, says", [
    (["a", "b", "c", "d", "e"], "too_many_stop_sequences", "5 stop sequences; at most 4"),
    (["ok", "x" * 257], "stop_sequence_too_long", "257 characters; at most 256"),
])
def test_stops_past_the_limits_are_400_naming_stop(stops, code, says):
    with pytest.raises(APIError) as refused:
        LIMITS.check_stops(stops)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, "stop", code)
    assert says in refused.value.message


def test_prompt_count():
    LIMITS.check_prompt_count(16)
    with pytest.raises(APIError) as refused:
        LIMITS.check_prompt_count(17)
    error = refused.value
    assert (error.status, error.param, error.code) == (400, "prompt", "too_many_prompts")
    assert "17 prompts" in error.message and "--max-prompts-per-request" in error.message


def test_settings_defaults_and_bounds():
    settings = OrchestratorSettings()
    assert (settings.max_prompts_per_request, settings.max_stop_sequences, settings.max_stop_length) == (16, 4, 256)
    for name in ("max_prompts_per_request", "max_stop_sequences", "max_stop_length", "max_request_bytes",
                 "max_connections", "max_header_bytes"):
        with pytest.raises(ValueError, match=name):
            OrchestratorSettings(**{name: 0})
    with pytest.raises(ValueError, match="header_timeout_seconds"):
        OrchestratorSettings(header_timeout_seconds=0)


async def test_large_bodies_are_tokenized_off_the_event_loop():
    loop_thread = threading.get_ident()

    def encode(text: str) -> int:
        return threading.get_ident()

    assert await tokenize_off_loop_if_large(4095, 4096, encode, "small") == loop_thread
    assert await tokenize_off_loop_if_large(4096, 4096, encode, "large") != loop_thread
