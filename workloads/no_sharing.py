"""The **no-sharing** workload, a negative control: every prompt is its own text from its
first word on, so no two requests can share a KV block::

    request i:  [system: instructions i]  [user: text i]   max_tokens

* ``requests`` prompts of ``prompt_min_tokens``..``prompt_max_tokens`` in all (about a
  tenth of it the system turn, which starts with a word only request ``i`` has);
* arrivals: a Poisson process of ``rate`` requests per second.

Only the chat template's few framing tokens (``<|im_start|>system``) are common to all,
far less than one KV block. So every policy should see a hit rate of ~0, and a cache-
aware policy should do as well as the best cache-blind one: this is the workload on
which chasing cached prefixes must cost nothing. ``group`` is the request's index.
"""

from __future__ import annotations

from dataclasses import dataclass

from workloads.base import (
    TokenCounter,
    WorkloadRequest,
    approx_tokens,
    check_bounds,
    check_positive_rate,
    int_between,
    poisson_arrivals,
    seeded_rng,
)
from workloads.pseudotext import filler_text, index_word, vocabulary

SYSTEM_SHARE = 0.1  # of a prompt's tokens, in its (unique) system turn
MIN_PROMPT_TOKENS = 20  # room for both turns' headings


@dataclass(frozen=True)
class NoSharingConfig:
    requests: int = 200
    rate: float = 1.0  # requests per second (Poisson)
    prompt_min_tokens: int = 200
    prompt_max_tokens: int = 1000
    max_tokens: int = 16
    seed: int = 0

    def __post_init__(self):
        if self.requests < 0 or self.max_tokens < 1:
            raise ValueError("need requests >= 0 and max_tokens >= 1")
        check_positive_rate(self.rate)
        check_bounds(self.prompt_min_tokens, self.prompt_max_tokens, "prompt")
        if self.prompt_min_tokens < MIN_PROMPT_TOKENS:
            raise ValueError(f"prompt_min_tokens must be >= {MIN_PROMPT_TOKENS}")


def unique_messages(config: NoSharingConfig, index: int, count_tokens: TokenCounter | None = None) -> list[dict]:
    """Request ``index``'s two turns, each headed by ``index_word(index)`` and its own words."""
    count = count_tokens or approx_tokens
    rng = seeded_rng(config.seed, "unique", index)
    words, name = vocabulary(rng, 120), index_word(index).capitalize()
    target = int_between(rng, config.prompt_min_tokens, config.prompt_max_tokens)
    system_target = max(int(target * SYSTEM_SHARE), MIN_PROMPT_TOKENS // 2)
    return [{"role": "system", "content": filler_text(rng, words, f"{name} desk rules.", system_target, count)},
            {"role": "user", "content": filler_text(rng, words, f"{name} asks:", target - system_target, count)}]


def generate_no_sharing(config: NoSharingConfig, count_tokens: TokenCounter | None = None) -> list[WorkloadRequest]:
    """The requests of the no-sharing workload, in arrival order."""
    arrivals = poisson_arrivals(seeded_rng(config.seed, "arrivals"), config.rate)
    return [WorkloadRequest(index, now, index, unique_messages(config, index, count_tokens), config.max_tokens)
            for index, now in zip(range(config.requests), arrivals)]
