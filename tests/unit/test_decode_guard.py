"""The step limits of worker.decode_guard: a cap on prompt tokens only while requests decode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from worker.decode_guard import CONFIG_KEY, SCHEDULER_CLASS, decode_guard_args, decoding_requests, step_limits
from worker.settings import WorkerSettings


def request(prompt: int, computed: int):
    return SimpleNamespace(num_prompt_tokens=prompt, num_computed_tokens=computed)


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


def test_engine_arguments_name_the_scheduler_only_when_capped():
    assert decode_guard_args(0) == {}
    assert decode_guard_args(256) == {"scheduler_cls": SCHEDULER_CLASS, "additional_config": {CONFIG_KEY: 256}}


def test_a_negative_cap_is_refused():
    with pytest.raises(ValueError, match="decoding_step_tokens"):
        WorkerSettings(role="unified", model="m", decoding_step_tokens=-1)
