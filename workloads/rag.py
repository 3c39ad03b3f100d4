"""The **rag** workload: retrieval-augmented questions from several tenants, each with its
own fixed instruction prefix, over passages retrieved from one shared corpus::

    request i:  [system: instructions(tenant t)]
                [user: "[p17] passage 17\\n[p3] passage 3\\n...\\nQuestion: ..."]   max_tokens

* tenants: ``tenants`` of them, named ``tenant-0``, ``tenant-1``, ...; tenant ``t`` sends
  with probability proportional to ``1 / (t + 1) ** tenant_zipf_exponent``. Its
  instructions are ``instruction_min_tokens``..``instruction_max_tokens`` long (drawn per
  tenant) and the same in every one of its requests;
* retrieval: ``passages_per_request`` distinct passages of the ``corpus_passages``-passage
  corpus, most relevant first; passage ``p`` is retrieved with probability proportional
  to ``1 / (p + 1) ** passage_zipf_exponent``, so a few passages come back often (and
  often first). Each passage is ``passage_min_tokens``..``passage_max_tokens`` long and
  the same text wherever it appears;
* question: ``question_min_tokens``..``question_max_tokens``, new in every request;
* arrivals: a Poisson process of ``rate`` requests per second.

Stresses: a two-level prefix. The tenant's instructions are a reliable shared prefix;
the passages after them extend it only when the same tenant retrieves the same leading
passages again, so hits are partial and popularity-driven. The corpus is shared, but a
passage is never a shared *prefix* across tenants (it follows a tenant's instructions),
which is also what tenant isolation demands: kvroute puts the tenant into the cache
namespace, so two tenants' requests never share blocks even when their tokens agree.

``tenant`` carries the tenant's name. ``kvroute bench replay`` sends every request with
one API key (``--api-key``), so it does not act as several tenants; the name is there
for a client that maps tenants onto keys, and for analysis. ``group`` is the tenant's
number.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from workloads.base import (
    TokenCounter,
    WorkloadRequest,
    approx_tokens,
    check_bounds,
    check_positive_rate,
    int_between,
    pick_weighted,
    poisson_arrivals,
    seeded_rng,
    zipf_cumulative,
)
from workloads.pseudotext import filler_text, index_word, vocabulary


@dataclass(frozen=True)
class RagConfig:
    tenants: int = 4
    requests: int = 200
    rate: float = 1.0  # requests per second (Poisson)
    instruction_min_tokens: int = 300
    instruction_max_tokens: int = 800
    corpus_passages: int = 400
    passages_per_request: int = 4
    passage_min_tokens: int = 80
    passage_max_tokens: int = 200
    question_min_tokens: int = 10
    question_max_tokens: int = 40
    tenant_zipf_exponent: float = 0.5
    passage_zipf_exponent: float = 1.0
    max_tokens: int = 16
    seed: int = 0

    def __post_init__(self):
        if self.tenants < 1 or self.requests < 0:
            raise ValueError("need at least one tenant and a non-negative number of requests")
        if not 1 <= self.passages_per_request <= self.corpus_passages:
            raise ValueError("need 1 <= passages_per_request <= corpus_passages")
        check_positive_rate(self.rate)
        for name in ("instruction", "passage", "question"):
            check_bounds(getattr(self, f"{name}_min_tokens"), getattr(self, f"{name}_max_tokens"), name)
        if self.tenant_zipf_exponent < 0 or self.passage_zipf_exponent < 0 or self.max_tokens < 1:
            raise ValueError("zipf exponents must be >= 0 and max_tokens >= 1")


def tenant_name(tenant: int) -> str:
    return f"tenant-{tenant}"


def tenant_instructions(config: RagConfig, tenant: int, count_tokens: TokenCounter | None = None) -> str:
    """Tenant ``tenant``'s instruction prefix: its own words from the first one on."""
    rng = seeded_rng(config.seed, "tenant", tenant)
    target = int_between(rng, config.instruction_min_tokens, config.instruction_max_tokens)
    brand = index_word(tenant).capitalize()
    return filler_text(rng, vocabulary(rng, 50), f"{brand} answers for {tenant_name(tenant)}.", target,
                       count_tokens or approx_tokens)


def passage(config: RagConfig, number: int, count_tokens: TokenCounter | None = None) -> str:
    """Passage ``number`` of the shared corpus, with its ``[pN]`` tag."""
    corpus_words = vocabulary(seeded_rng(config.seed, "corpus"), 300)
    rng = seeded_rng(config.seed, "passage", number)
    target = int_between(rng, config.passage_min_tokens, config.passage_max_tokens)
    return filler_text(rng, corpus_words, f"[p{number}]", target, count_tokens or approx_tokens)


def retrieve(rng: random.Random, cumulative: list[float], count: int) -> list[int]:
    """``count`` distinct passage numbers, in the order drawn (most relevant first)."""
    chosen: list[int] = []
    while len(chosen) < count:
        number = pick_weighted(rng, cumulative)
        if number not in chosen:
            chosen.append(number)
    return chosen


def generate_rag(config: RagConfig, count_tokens: TokenCounter | None = None) -> list[WorkloadRequest]:
    """The requests of the rag workload, in arrival order."""
    count = count_tokens or approx_tokens
    instructions: dict[int, str] = {}
    passages: dict[int, str] = {}
    tenants = zipf_cumulative(config.tenants, config.tenant_zipf_exponent)
    corpus = zipf_cumulative(config.corpus_passages, config.passage_zipf_exponent)
    schedule = seeded_rng(config.seed, "schedule")
    arrivals = poisson_arrivals(seeded_rng(config.seed, "arrivals"), config.rate)
    question_words = vocabulary(seeded_rng(config.seed, "question-words"), 80)
    requests = []
    for index, now in zip(range(config.requests), arrivals):
        tenant = pick_weighted(schedule, tenants)
        if tenant not in instructions:
            instructions[tenant] = tenant_instructions(config, tenant, count_tokens)
        context = []
        for number in retrieve(schedule, corpus, config.passages_per_request):
            if number not in passages:
                passages[number] = passage(config, number, count_tokens)
            context.append(passages[number])
        rng = seeded_rng(config.seed, "question", index)
        target = int_between(rng, config.question_min_tokens, config.question_max_tokens)
        question = filler_text(rng, question_words, "Question:", target, count)
        messages = [{"role": "system", "content": instructions[tenant]},
                    {"role": "user", "content": "\n".join(context + [question])}]
        requests.append(WorkloadRequest(index, now, tenant, messages, config.max_tokens, tenant=tenant_name(tenant)))
    return requests
