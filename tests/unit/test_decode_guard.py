"""The step limits of worker.decode_guard: a cap on prompt tokens only while requests decode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from foundation import wire
from worker.decode_guard import (
    MIN_STEP_TOKENS,
    SCHEDULER_CLASS,
    STEP_TOKENS_KEY,
    TPOT_TARGET_ARG,
    TPOT_TARGET_KEY,
    PrefillPace,
    StreamDeadlines,
    decode_guard_args,
    decode_guard_summary,
    decoding_requests,
    prompt_tokens_of,
    step_limits,
    tpot_step_tokens,
)
from worker.generation import sampling_params
from worker.settings import WorkerSettings


def request(prompt: int, computed: int, request_id: str = "r", outputs: int = 0, target: float | None = None):
    extra_args = {TPOT_TARGET_ARG: target} if target is not None else None
    return SimpleNamespace(num_prompt_tokens=prompt, num_computed_tokens=computed, request_id=request_id,
                           num_output_tokens=outputs, sampling_params=SimpleNamespace(extra_args=extra_args))


def test_requests_past_their_prompt_are_the_decoding_ones():
    running = [request(100, 100), request(100, 140), request(3000, 512), request(40, 0)]
    assert decoding_requests(running) == 2
    assert decoding_requests([]) == 0


@pytest.mark.parametrize("cap, decoding, budget, per_prompt, expected", [
    (0, 3, 2048, 0, (2048, 0)),        # no guard: the engine's own limits
    (256, 0, 2048, 0, (2048, 0)),      # nobody decoding: prompts take whole steps
    (256, 3, 2048, 0, (259, 256)),     # one token for each stream, 256 for the prompt
    (256, 3, 2048, 128, (259, 128)),   # a smaller per-prompt cap stands
    (256, 3, 2048, 512, (259, 256)),
    (256, 3, 200, 0, (200, 256)),      # never above the engine's budget
])
def test_step_limits(cap, decoding, budget, per_prompt, expected):
    assert step_limits(cap, decoding, budget, per_prompt) == expected


def test_engine_arguments_name_the_scheduler_and_its_caps():
    assert decode_guard_args(256) == {"scheduler_cls": SCHEDULER_CLASS,
                                      "additional_config": {STEP_TOKENS_KEY: 256, TPOT_TARGET_KEY: 0.0}}
    assert decode_guard_args(0, 0.15)["additional_config"] == {STEP_TOKENS_KEY: 0, TPOT_TARGET_KEY: 0.15}
    assert decode_guard_args(256, 0.0, cuda_available=True) == {}  # vLLM's own (asynchronous) scheduler


@pytest.mark.parametrize("settings, message", [
    ({"decoding_step_tokens": -1}, "decoding_step_tokens must be"),
    ({"decoding_tpot_target": -0.1}, "decoding_tpot_target must be"),
    ({"decoding_step_tokens": 256, "decoding_tpot_target": 0.15}, "not both"),
])
def test_bad_caps_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        WorkerSettings(role="unified", model="m", **settings)


def test_the_pace_follows_timed_prompt_steps_only():
    pace = PrefillPace(1000.0)
    pace.observe(20, 0.001)  # a step of decodes says nothing of prefill speed
    assert pace.tokens_per_second == 1000.0
    for _ in range(50):
        pace.observe(256, 0.5)
    assert pace.tokens_per_second == pytest.approx(512.0, rel=1e-3)


def test_prompt_tokens_of_a_step_leave_out_single_next_tokens():
    assert prompt_tokens_of({"a": 1, "b": 256, "c": 1, "d": 40}) == 296


def test_a_stream_ahead_of_its_average_lets_a_step_run_longer():
    deadlines = StreamDeadlines(default_target=0.15)
    fresh, ahead = request(40, 41, "fresh", outputs=1), request(40, 49, "ahead", outputs=9)
    deadlines.observe([ahead], now=10.0)
    deadlines.observe([fresh], now=11.0)
    # "ahead" has 9 tokens since 10.0: its 10th is due at 10.0 + 9 x 0.15 = 11.35.
    assert deadlines.step_seconds([ahead], now=11.0) == pytest.approx(0.35)
    # "fresh" has its first token only: the next is due 0.15 s after it. The tightest counts.
    assert deadlines.step_seconds([ahead, fresh], now=11.0) == pytest.approx(0.15)
    # A stream behind its average still lets a step take one target's time.
    assert deadlines.step_seconds([ahead], now=12.0) == pytest.approx(0.15)
    assert deadlines.step_seconds([request(3000, 512, "prefilling")], now=11.0) is None
    deadlines.forget_all_but({"fresh"})
    assert deadlines.step_seconds([ahead, fresh], now=11.0) == pytest.approx(0.15)
    assert deadlines.step_seconds([ahead], now=11.0) is None


def test_a_request_s_own_target_wins_over_the_engine_s():
    deadlines = StreamDeadlines(default_target=0.0)
    tight, loose, none = (request(40, 41, "tight", 1, target=0.05), request(40, 41, "loose", 1, target=0.5),
                          request(40, 41, "none", 1))
    deadlines.observe([tight, loose, none], now=5.0)
    assert deadlines.step_seconds([loose, none], now=5.0) == pytest.approx(0.5)
    assert deadlines.step_seconds([loose, tight, none], now=5.0) == pytest.approx(0.05)
    assert deadlines.step_seconds([none], now=5.0) is None  # neither it nor the engine sets a target


def test_a_step_of_seconds_becomes_prompt_tokens_at_the_measured_pace():
    pace = PrefillPace(900.0)
    assert tpot_step_tokens(None, pace, 2048) == 0  # nobody decodes: no cap
    assert tpot_step_tokens(0.15, pace, 2048) == 135
    assert tpot_step_tokens(10.0, pace, 2048) == 2048
    assert tpot_step_tokens(0.01, pace, 2048) == MIN_STEP_TOKENS


def test_a_generate_request_s_target_reaches_the_engine():
    with_target = sampling_params(wire.GenerateRequest(request_id="a", prompt_token_ids=[1, 2],
                                                       sampling=wire.SamplingSpec(tpot_target=0.15)))
    assert with_target.extra_args[TPOT_TARGET_ARG] == 0.15
    without = sampling_params(wire.GenerateRequest(request_id="b", prompt_token_ids=[1, 2]))
    assert TPOT_TARGET_ARG not in without.extra_args


@pytest.mark.parametrize("target", [0.0, -1.0, float("nan"), float("inf"), 10.5])
def test_a_target_out_of_bounds_is_not_passed_on(target):
    params = sampling_params(wire.GenerateRequest(request_id="c", prompt_token_ids=[1],
                                                  sampling=wire.SamplingSpec(tpot_target=target)))
    assert TPOT_TARGET_ARG not in params.extra_args


def test_the_log_says_what_the_engine_does_beside_decodes():
    assert decode_guard_summary({}) == "vLLM's own (whole steps; a GPU engine)"
    assert decode_guard_summary(decode_guard_args(256)["additional_config"]) == "at most 256 prompt tokens"
    assert "(0.2 s a token without one)" in decode_guard_summary(decode_guard_args(0, 0.2)["additional_config"])
    assert "whole steps" in decode_guard_summary(decode_guard_args(0, 0.0)["additional_config"])
