"""The usage of a response (orchestrator.api.usage): prompt tokens of every choice's job,
cached ones, and of those the ones loaded from the node KV tier."""

from __future__ import annotations

from foundation import wire
from orchestrator.api import usage
from orchestrator.service import Job, Outcome


def job(prompt_tokens: int) -> Job:
    return Job(prompt_token_ids=list(range(prompt_tokens)), sampling=wire.SamplingSpec(), cache_salt="s")


def test_cached_and_tier_tokens_add_up_over_choices():
    outcomes = [Outcome(completion_tokens=3, cached_tokens=64, tier_tokens=32), Outcome(completion_tokens=2)]
    assert usage([job(100), job(50)], outcomes) == {
        "prompt_tokens": 150, "completion_tokens": 5, "total_tokens": 155,
        "prompt_tokens_details": {"cached_tokens": 64, "tier_cached_tokens": 32}}
