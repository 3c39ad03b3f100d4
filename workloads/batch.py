"""The **batch** workload: many independent long-ish prompts that all arrive at once, as an
offline job (summarise every document of a folder) submits them::

    request i:  [system: one short instruction]  [user: document i]   max_tokens

* ``requests`` documents of ``document_min_tokens``..``document_max_tokens`` each, every
  one its own text from its title on;
* the instruction (``instruction_tokens``, the same for all) is the only shared text:
  at a block size of 32 (kvroute's CPU default) or more, at most one block of it is worth anything;
* arrivals: all at 0 s.

Stresses: throughput and load balance under a burst, with almost nothing to reuse: a
cache-aware policy must spread the work as well as ``least_loaded`` would instead of
piling requests onto the worker that holds the instruction. ``group`` is the request's
own index (every document is its own group).
"""

from __future__ import annotations

from dataclasses import dataclass

from workloads.base import (
    TokenCounter,
    WorkloadRequest,
    approx_tokens,
    check_at_least_one,
    check_bounds,
    int_between,
    seeded_rng,
)
from workloads.pseudotext import filler_text, index_word, seeded_text, vocabulary


@dataclass(frozen=True)
class BatchConfig:
    requests: int = 64
    instruction_tokens: int = 40
    document_min_tokens: int = 1000
    document_max_tokens: int = 2000
    max_tokens: int = 64
    seed: int = 0

    def __post_init__(self):
        if self.requests < 0:
            raise ValueError("requests must be >= 0")
        check_at_least_one(instruction_tokens=self.instruction_tokens, max_tokens=self.max_tokens)
        check_bounds(self.document_min_tokens, self.document_max_tokens, "document")


def batch_instruction(config: BatchConfig, count_tokens: TokenCounter | None = None) -> str:
    return seeded_text("Summarise the document below in three lines.", config.instruction_tokens, count_tokens,
                       config.seed, "batch-instruction", words=30)


def document(config: BatchConfig, index: int, count_tokens: TokenCounter | None = None) -> str:
    """Document ``index``: its own words, under a title no other document has."""
    rng = seeded_rng(config.seed, "document", index)
    target = int_between(rng, config.document_min_tokens, config.document_max_tokens)
    title = f"{index_word(index).capitalize()} {index_word(config.seed)} report"
    return filler_text(rng, vocabulary(rng, 120), title, target, count_tokens or approx_tokens)


def generate_batch(config: BatchConfig, count_tokens: TokenCounter | None = None) -> list[WorkloadRequest]:
    """The requests of the batch workload, all arriving at 0 s."""
    instruction = batch_instruction(config, count_tokens)
    return [WorkloadRequest(index, 0.0, index, [{"role": "system", "content": instruction},
                                               {"role": "user", "content": document(config, index, count_tokens)}],
                            config.max_tokens)
            for index in range(config.requests)]
