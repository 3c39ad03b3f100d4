"""The **prefix-repetition** workload, in the shape of vLLM's ``prefix_repetition`` benchmark
dataset (``--prefix-repetition-*`` options there), for numbers comparable with vLLM's::

    prefix k, repetition r:  [system: prefix k]  [user: suffix (k, r)]   output_tokens

* ``num_prefixes`` prefixes of ``prefix_tokens`` each, every one its own text;
* each used by ``repetitions_per_prefix`` requests, whose suffixes (``suffix_tokens``)
  are all distinct; ``num_prefixes x repetitions_per_prefix`` requests in all;
* ``output_tokens`` generated per request;
* order: shuffled (seeded), so prefixes interleave; arrivals a Poisson process of
  ``rate`` requests per second, by default ``inf``: all at once.

The lengths default to vLLM's (256, 256, 10 prefixes, 128 output tokens); vLLM derives
the repetitions from its total prompt count, here they are a field (default 10: 100
requests). vLLM sends prefix and suffix as one completion prompt of random token ids;
here the prefix is a system turn and the suffix a user turn, so the shared part ends on
a message boundary and tokenizes the same in every request.

Stresses: a small, fixed set of hot prefixes that every worker could hold: the question
is whether a policy keeps reusing them or spreads copies; compare with
``generated-shared-prefix`` (many groups, a working set larger than one cache).
``group`` is the prefix's number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workloads.base import TokenCounter, WorkloadRequest, check_at_least_one, check_positive_rate
from workloads.pseudotext import index_word, seeded_text
from workloads.shared_prefix import grouped_requests


@dataclass(frozen=True)
class PrefixRepetitionConfig:
    num_prefixes: int = 10
    prefix_tokens: int = 256
    suffix_tokens: int = 256
    repetitions_per_prefix: int = 10
    output_tokens: int = 128
    rate: float = math.inf  # requests per second (Poisson); inf: all at once
    seed: int = 0

    def __post_init__(self):
        check_at_least_one(num_prefixes=self.num_prefixes, repetitions_per_prefix=self.repetitions_per_prefix,
                           prefix_tokens=self.prefix_tokens, suffix_tokens=self.suffix_tokens,
                           output_tokens=self.output_tokens)
        check_positive_rate(self.rate)


def repeated_prefix(config: PrefixRepetitionConfig, number: int, count_tokens: TokenCounter | None = None) -> str:
    return seeded_text(f"{index_word(number).capitalize()} context.", config.prefix_tokens, count_tokens,
                       config.seed, "repeated-prefix", number)


def suffix(config: PrefixRepetitionConfig, number: int, repetition: int,
           count_tokens: TokenCounter | None = None) -> str:
    return seeded_text(f"Task {index_word(repetition)}:", config.suffix_tokens, count_tokens,
                       config.seed, "suffix", number, repetition, words=40)


def generate_prefix_repetition(config: PrefixRepetitionConfig,
                               count_tokens: TokenCounter | None = None) -> list[WorkloadRequest]:
    """The num_prefixes x repetitions_per_prefix requests, shuffled, in arrival order."""
    return grouped_requests(config.seed, "prefix-repetition", config.num_prefixes, config.repetitions_per_prefix,
                            config.rate, config.output_tokens,
                            lambda number: repeated_prefix(config, number, count_tokens),
                            lambda number, repetition: suffix(config, number, repetition, count_tokens))
