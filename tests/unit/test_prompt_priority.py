"""Shortest-expected-prefill-first priorities (worker.prompt_priority): lower goes first; a short
prompt overtakes a long one only within about the long one's own prefill time."""

from __future__ import annotations

import pytest

from foundation import wire
from worker.prompt_priority import (
    DEFAULT_PREFILL_TOKENS_PER_SECOND,
    FCFS,
    SHORTEST_FIRST,
    PromptPriorities,
    check_scheduling,
    engine_policy,
)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def priorities(rate: float = 1000.0) -> tuple[PromptPriorities, Clock]:
    clock = Clock()
    return PromptPriorities(wire.PrefillProbe(new_tokens=int(rate), seconds=1.0), clock), clock


def test_a_short_prompt_arriving_during_a_long_ones_prefill_time_goes_first():
    ranks, clock = priorities()
    long = ranks.of(2000)  # alone it would prefill in 2 s
    clock.now += 1.5
    short = ranks.of(60)
    assert short < long


def test_a_long_prompt_is_not_overtaken_by_prompts_arriving_after_its_own_prefill_time():
    ranks, clock = priorities()
    long = ranks.of(2000)
    clock.now += 2.1
    assert ranks.of(0) > long and ranks.of(60) > long


def test_prompts_of_one_size_keep_their_arrival_order():
    ranks, clock = priorities()
    first = ranks.of(500)
    clock.now += 0.01
    assert ranks.of(500) > first


def test_the_rate_is_the_probes_and_a_default_without_one():
    assert priorities(2500.0)[0].tokens_per_second == 2500.0
    assert PromptPriorities(None).tokens_per_second == DEFAULT_PREFILL_TOKENS_PER_SECOND
    assert PromptPriorities(wire.PrefillProbe(new_tokens=128, seconds=0.0)).tokens_per_second == \
        DEFAULT_PREFILL_TOKENS_PER_SECOND


def test_the_engine_runs_vllms_priority_policy_only_for_shortest_first():
    assert engine_policy(SHORTEST_FIRST) == "priority" and engine_policy(FCFS) == "fcfs"
    assert check_scheduling(SHORTEST_FIRST) == SHORTEST_FIRST
    with pytest.raises(ValueError, match="scheduling must be one of fcfs, shortest-first"):
        check_scheduling("lifo")
