"""The **generated-shared-prefix** workload, in the shape of SGLang's ``bench_serving``
dataset of that name (``--gsp-*`` options there), for numbers comparable with SGLang's::

    group g, prompt j:  [system: system prompt g]  [user: question (g, j)]   output_tokens

* ``groups`` (G) system prompts of ``system_prompt_tokens`` (S) each, every group's its own
  text from the first word on;
* ``prompts_per_group`` (P) questions of ``question_tokens`` (Q) per group, all distinct;
* ``output_tokens`` (O) generated per request (``max_tokens``);
* order: the G x P requests shuffled (seeded), so groups interleave; arrivals a Poisson
  process of ``rate`` requests per second, by default ``inf``: all at once.

Lengths are pseudo-text fitted to the targets with ``approx_tokens`` (or the
``count_tokens`` given), so a prompt has S + Q tokens to within a few, where SGLang's
random token ids hit them exactly.

Defaults (SGLang's): G x P = 64 x 16 = 1,024 requests, S = 2,048, Q = 128, O = 256. That
is ~2.2 million prompt tokens and 262,144 generated ones: far too big for a 2-core CPU
machine (hours of prefill). Scale it down with the config, or in a replay with
``--workload-option groups=8,prompts_per_group=4,system_prompt_tokens=512,question_tokens=32,
output_tokens=16,rate=2``. The tests use ``groups=4, prompts_per_group=3,
system_prompt_tokens=128, question_tokens=16, output_tokens=8``.

Stresses: group-affine placement: every group's system prompt is worth caching once per
group and reusing P - 1 times, and with G large the working set exceeds one worker's
cache, so spreading groups over workers beats both round robin and one hot worker.
``group`` is the group's number.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from workloads.base import (
    TokenCounter,
    WorkloadRequest,
    check_at_least_one,
    check_positive_rate,
    poisson_arrivals,
    seeded_rng,
    shuffled,
)
from workloads.pseudotext import index_word, seeded_text


@dataclass(frozen=True)
class GeneratedSharedPrefixConfig:
    groups: int = 64
    prompts_per_group: int = 16
    system_prompt_tokens: int = 2048
    question_tokens: int = 128
    output_tokens: int = 256
    rate: float = math.inf  # requests per second (Poisson); inf: all at once
    seed: int = 0

    def __post_init__(self):
        check_at_least_one(groups=self.groups, prompts_per_group=self.prompts_per_group,
                           system_prompt_tokens=self.system_prompt_tokens, question_tokens=self.question_tokens,
                           output_tokens=self.output_tokens)
        check_positive_rate(self.rate)


def grouped_requests(seed: int, label: str, groups: int, per_group: int, rate: float, max_tokens: int,
                     system_of: Callable[[int], str], user_of: Callable[[int, int], str]) -> list[WorkloadRequest]:
    """``groups`` x ``per_group`` requests ``[system: system_of(g)] [user: user_of(g, j)]``,
    shuffled so groups interleave, arriving as a Poisson process of ``rate`` (inf: at once).
    The shape both peers' shared-prefix benchmarks have; ``label`` keeps their streams apart."""
    systems = [system_of(group) for group in range(groups)]
    pairs = shuffled(seeded_rng(seed, label, "order"), [(g, j) for g in range(groups) for j in range(per_group)])
    arrivals = poisson_arrivals(seeded_rng(seed, label, "arrivals"), rate)
    return [WorkloadRequest(index, now, group, [{"role": "system", "content": systems[group]},
                                                {"role": "user", "content": user_of(group, member)}], max_tokens)
            for index, ((group, member), now) in enumerate(zip(pairs, arrivals))]


def system_prompt(config: GeneratedSharedPrefixConfig, group: int, count_tokens: TokenCounter | None = None) -> str:
    return seeded_text(f"{index_word(group).capitalize()} group instructions.", config.system_prompt_tokens,
                       count_tokens, config.seed, "gsp-system", group, words=80)


def group_question(config: GeneratedSharedPrefixConfig, group: int, prompt: int,
                   count_tokens: TokenCounter | None = None) -> str:
    return seeded_text(f"Question {index_word(prompt)}:", config.question_tokens, count_tokens,
                       config.seed, "gsp-question", group, prompt, words=40)


def generate_shared_prefix(config: GeneratedSharedPrefixConfig,
                           count_tokens: TokenCounter | None = None) -> list[WorkloadRequest]:
    """The G x P requests, shuffled, in arrival order."""
    return grouped_requests(config.seed, "gsp", config.groups, config.prompts_per_group, config.rate,
                            config.output_tokens, lambda group: system_prompt(config, group, count_tokens),
                            lambda group, prompt: group_question(config, group, prompt, count_tokens))
