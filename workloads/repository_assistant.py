"""The **repository-assistant** workload: a coding assistant serves R repositories. Each
repository has one long shared prefix, its system turn (a system prompt, the tool
definitions and a map of the repository), and users ask it many short questions::

    request i:  [system: prefix(repository r)]  [user: question i about r]   max_tokens

* prefix length: drawn per repository, uniformly in ``[prefix_min_tokens, prefix_max_tokens]``;
* question length: drawn per request, uniformly in ``[question_min_tokens, question_max_tokens]``;
* popularity: repository ``r`` (0-based) is picked with probability proportional to
  ``1 / (r + 1) ** zipf_exponent``; the default exponent, 0.3, is mildly skewed, so
  repository 0 is the most popular but every repository keeps coming back;
* arrivals: a Poisson process of ``rate`` requests per second (exponential gaps); the
  first request arrives after one gap, not at 0.

Stresses: placement that keeps a repository's requests where its long prefix is cached,
without turning the most popular repository's worker into a hotspot.

The text is deterministic pseudo-text built from the seed: repository-specific code names
and identifiers (``src/<code>/<dir>/<module>.py: class ...``) on every line, so two
repositories share no text beyond the chat template and short fixed fragments such as
``class``: every prompt differs from every other repository's within its first KV block,
and only requests for the same repository can share cached blocks. The prefix of
repository 3 depends on the seed and the length bounds only, not on how many requests or
repositories are asked for.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from workloads.base import (
    TokenCounter,
    WorkloadRequest,
    approx_tokens,
    exponential,
    fit_lines,
    int_between,
    pick,
    pick_weighted,
    seeded_rng,
    zipf_cumulative,
)
from workloads.pseudotext import made_up_word

_LANGUAGES = ("Python", "Python and Cython", "Python with Rust extensions", "Python and C")
_VERB_COUNT, _NOUN_COUNT, _WORD_COUNT = 12, 16, 40


@dataclass(frozen=True)
class RepositoryAssistantConfig:
    repositories: int = 30
    requests: int = 200
    rate: float = 1.0  # requests per second (Poisson)
    prefix_min_tokens: int = 1000
    prefix_max_tokens: int = 3000
    question_min_tokens: int = 20
    question_max_tokens: int = 60
    zipf_exponent: float = 0.3
    max_tokens: int = 16
    seed: int = 0

    def __post_init__(self):
        if self.repositories < 1 or self.requests < 0:
            raise ValueError("need at least one repository and a non-negative number of requests")
        if not self.rate > 0 or not math.isfinite(self.rate):
            raise ValueError("rate must be a positive number of requests per second")
        if not 1 <= self.prefix_min_tokens <= self.prefix_max_tokens:
            raise ValueError("need 1 <= prefix_min_tokens <= prefix_max_tokens")
        if not 1 <= self.question_min_tokens <= self.question_max_tokens:
            raise ValueError("need 1 <= question_min_tokens <= question_max_tokens")
        if self.zipf_exponent < 0:
            raise ValueError("zipf_exponent must be >= 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")


# ---------------------------------------------------------------- repository vocabulary


@dataclass(frozen=True)
class _Vocabulary:
    """The made-up names of one repository; questions and the repository map share them."""

    repository: int
    code: str  # e.g. "draulix": package name, prefix of tool names
    org: str
    team: str
    language: str
    verbs: tuple[str, ...]
    nouns: tuple[str, ...]
    words: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.org}/{self.code}"

    def cls(self, rng: random.Random) -> str:
        return f"{pick(rng, self.words).capitalize()}{pick(rng, self.nouns).capitalize()}{self.repository}"

    def method(self, rng: random.Random) -> str:
        return f"{pick(rng, self.verbs)}_{pick(rng, self.nouns)}"

    def module(self, rng: random.Random) -> str:
        return f"src/{self.code}/{pick(rng, self.words)}/{pick(rng, self.nouns)}_{pick(rng, self.words)}.py"


def _vocabulary(seed: int, repository: int) -> _Vocabulary:
    rng = seeded_rng(seed, "vocabulary", repository)
    return _Vocabulary(
        repository=repository, code=made_up_word(rng, 3), org=made_up_word(rng, 2),
        team=made_up_word(rng, 2).capitalize(),
        language=pick(rng, _LANGUAGES),
        verbs=tuple(made_up_word(rng, 2) for _ in range(_VERB_COUNT)),
        nouns=tuple(made_up_word(rng, 2) for _ in range(_NOUN_COUNT)),
        words=tuple(made_up_word(rng, int_between(rng, 2, 3)) for _ in range(_WORD_COUNT)))


# ---------------------------------------------------------------- prefixes


def _header(v: _Vocabulary) -> list[str]:
    bot = f"{v.code.capitalize()}Bot"
    return [
        f"You are {bot}, the code assistant of {v.name} (repository {v.repository}).",
        f"{v.name} is written in {v.language}; team {v.team} maintains {v.code}.",
        f"Answer questions about {v.code} with the {v.code} tools and the {v.code} map below.",
        f"Quote {v.code} paths exactly; say so when the {v.code} map lacks the answer.",
        "",
        f"# {v.code} tools",
    ]


def _tool_line(v: _Vocabulary, rng: random.Random) -> str:
    verb, noun, other = pick(rng, v.verbs), pick(rng, v.nouns), pick(rng, v.nouns)
    return (f"- {v.code}_{verb}_{noun}({pick(rng, v.words)}: str, {pick(rng, v.words)}: int = "
            f"{int_between(rng, 1, 512)}) -> {v.cls(rng)}: {verb}s the {noun} of a {v.code} {other}.")


def _map_line(v: _Vocabulary, rng: random.Random) -> str:
    return (f"{v.module(rng)}: class {v.cls(rng)}({v.cls(rng)}) {pick(rng, v.verbs)}s "
            f"{pick(rng, v.nouns)}; defs {v.method(rng)}(), {v.method(rng)}({pick(rng, v.words)}), "
            f"{v.method(rng)}({pick(rng, v.words)}, {pick(rng, v.nouns)}) [{int_between(rng, 12, 900)} lines]")


def prefix_target_tokens(config: RepositoryAssistantConfig, repository: int) -> int:
    """The length drawn for ``repository``'s prefix, in tokens."""
    return int_between(seeded_rng(config.seed, "prefix-length", repository),
                        config.prefix_min_tokens, config.prefix_max_tokens)


def repository_prefix(config: RepositoryAssistantConfig, repository: int,
                      count_tokens: TokenCounter | None = None) -> str:
    """The shared system turn of ``repository``: prompt, tools, then the repository map."""
    count = count_tokens or approx_tokens
    v = _vocabulary(config.seed, repository)
    rng = seeded_rng(config.seed, "prefix-text", repository)
    lines = _header(v) + [_tool_line(v, rng) for _ in range(6)] + ["", f"# {v.code} map"]
    return fit_lines(lines, prefix_target_tokens(config, repository), count, lambda: _map_line(v, rng))


def repository_prefixes(config: RepositoryAssistantConfig, count_tokens: TokenCounter | None = None) -> list[str]:
    return [repository_prefix(config, r, count_tokens) for r in range(config.repositories)]


# ---------------------------------------------------------------- questions


def _question(v: _Vocabulary, rng: random.Random, target: int, limit: int, count: TokenCounter) -> str:
    openers = (
        lambda: f"In {v.code}, where is {v.cls(rng)} defined, and who calls {v.method(rng)}()?",
        lambda: f"Why would {v.method(rng)}({pick(rng, v.words)}) in {v.module(rng)} return None?",
        lambda: f"What does {v.cls(rng)}.{v.method(rng)} do with its {pick(rng, v.nouns)}?",
        lambda: f"Which {v.code} tool should I use to {pick(rng, v.verbs)} a {pick(rng, v.nouns)}?",
        lambda: f"Is {v.module(rng)} safe to call from two threads at once?",
    )
    extras = (
        lambda: f" Assume {pick(rng, v.words)} is {int_between(rng, 0, 999)}.",
        lambda: f" Mention {v.cls(rng)} if it matters.",
        lambda: f" Compare it with {v.method(rng)}().",
        lambda: f" I am on the {pick(rng, v.words)} branch.",
        lambda: " Keep it short.",
    )
    text = pick(rng, openers)()
    for _ in range(64):  # extras that would pass ``limit`` are skipped; "Keep it short." nearly always fits
        if count(text) >= target:
            break
        longer = text + pick(rng, extras)()
        if count(longer) <= limit:
            text = longer
    while count(text) > limit and " " in text:  # only if an opener alone is over the limit
        text = text.rsplit(" ", 1)[0]
    return text


# ---------------------------------------------------------------- the workload


def generate_workload(config: RepositoryAssistantConfig,
                      count_tokens: TokenCounter | None = None) -> list[WorkloadRequest]:
    """The requests of the repository-assistant workload, in arrival order."""
    count = count_tokens or approx_tokens
    prefixes: dict[int, str] = {}
    cumulative = zipf_cumulative(config.repositories, config.zipf_exponent)
    schedule = seeded_rng(config.seed, "schedule")
    requests, now = [], 0.0
    for index in range(config.requests):
        now += exponential(schedule, config.rate)
        repository = pick_weighted(schedule, cumulative)
        if repository not in prefixes:
            prefixes[repository] = repository_prefix(config, repository, count_tokens)
        rng = seeded_rng(config.seed, "question", index)
        target = int_between(rng, config.question_min_tokens, config.question_max_tokens)
        question = _question(_vocabulary(config.seed, repository), rng, target, config.question_max_tokens, count)
        messages = [{"role": "system", "content": prefixes[repository]}, {"role": "user", "content": question}]
        requests.append(WorkloadRequest(index, now, repository, messages, config.max_tokens))
    return requests
