"""Seeded workload generators for placement benchmarks (not part of the serving path).

The **repository-assistant** workload: a coding assistant serves R repositories. Each
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

The text is deterministic pseudo-text built from the seed: repository-specific code names
and identifiers (``src/<code>/<dir>/<module>.py: class ...``) on every line, so two
repositories share no text beyond the chat template and short fixed fragments such as
``class``: every prompt differs from every other repository's within its first KV block,
and only requests for the same repository can share cached blocks.

Pure and deterministic: the same config (and the same token counter) gives the same
requests on every machine and Python version. Only ``random.Random.random()`` is used,
seeded per purpose from a SHA-256 of the seed and a label, so, e.g., the prefix of
repository 3 depends on the seed and the length bounds only, not on how many requests
or repositories are asked for.

Lengths are in tokens of the model's tokenizer when a ``count_tokens`` callable is given
(see ``tokenizer_counter``), else estimated with ``approx_tokens``, a characters-per-token
ratio measured for this pseudo-text with SmolLM2's tokenizer.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

TokenCounter = Callable[[str], int]

# Without a tokenizer, tokens are estimated from pieces: each word counts one token per
# started LETTERS_PER_TOKEN letters, each number, punctuation mark and newline one. On this
# pseudo-text that is within ~10% of SmolLM2's tokenizer (a little under it for prefixes,
# a little over it for questions); made-up identifiers split into ~2 characters a token.
LETTERS_PER_TOKEN = 3.0
_PIECES = re.compile(r"[A-Za-z][a-z]*|\d{1,3}|[^\sA-Za-z\d]|\n")

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr",
           "kl", "pl", "st", "tr", "sh", "ch", "th")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_CODAS = ("", "", "", "n", "r", "s", "l", "x", "k", "m")
_LANGUAGES = ("Python", "Python and Cython", "Python with Rust extensions", "Python and C")
_VERB_COUNT, _NOUN_COUNT, _WORD_COUNT = 12, 16, 40


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: send ``messages`` at ``arrival_seconds`` after the start."""

    index: int
    arrival_seconds: float
    repository: int
    messages: list[dict[str, str]]  # chat format: [{"role": "system", ...}, {"role": "user", ...}]
    max_tokens: int

    @property
    def prefix(self) -> str:
        """The repository's shared system turn."""
        return self.messages[0]["content"]

    @property
    def question(self) -> str:
        return self.messages[-1]["content"]


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


# ---------------------------------------------------------------- randomness


def _rng(seed: int, *labels: object) -> random.Random:
    """An independent stream per purpose: SHA-256 of the seed and labels seeds it."""
    digest = hashlib.sha256(repr((int(seed),) + labels).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _int_between(rng: random.Random, low: int, high: int) -> int:
    """Uniform in [low, high], from ``random()`` alone (stable across Python versions)."""
    return low + min(int(rng.random() * (high - low + 1)), high - low)


def _pick(rng: random.Random, items: Sequence):
    return items[_int_between(rng, 0, len(items) - 1)]


def _exponential(rng: random.Random, rate: float) -> float:
    return -math.log(1.0 - rng.random()) / rate


def zipf_weights(count: int, exponent: float) -> list[float]:
    """Normalised popularity of items 0..count-1: proportional to 1 / (rank + 1) ** exponent."""
    raw = [1.0 / (rank + 1) ** exponent for rank in range(count)]
    total = sum(raw)
    return [weight / total for weight in raw]


def approx_tokens(text: str) -> int:
    """Token count estimate without a tokenizer (see ``LETTERS_PER_TOKEN``)."""
    return sum(math.ceil(len(piece) / LETTERS_PER_TOKEN) if piece[0].isalpha() else 1
               for piece in _PIECES.findall(text))


# ---------------------------------------------------------------- repository vocabulary


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(_pick(rng, _ONSETS) + _pick(rng, _VOWELS) for _ in range(syllables - 1)) + \
        _pick(rng, _ONSETS) + _pick(rng, _VOWELS) + _pick(rng, _CODAS)


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
        return f"{_pick(rng, self.words).capitalize()}{_pick(rng, self.nouns).capitalize()}{self.repository}"

    def method(self, rng: random.Random) -> str:
        return f"{_pick(rng, self.verbs)}_{_pick(rng, self.nouns)}"

    def module(self, rng: random.Random) -> str:
        return f"src/{self.code}/{_pick(rng, self.words)}/{_pick(rng, self.nouns)}_{_pick(rng, self.words)}.py"


def _vocabulary(seed: int, repository: int) -> _Vocabulary:
    rng = _rng(seed, "vocabulary", repository)
    return _Vocabulary(
        repository=repository, code=_word(rng, 3), org=_word(rng, 2), team=_word(rng, 2).capitalize(),
        language=_pick(rng, _LANGUAGES),
        verbs=tuple(_word(rng, 2) for _ in range(_VERB_COUNT)),
        nouns=tuple(_word(rng, 2) for _ in range(_NOUN_COUNT)),
        words=tuple(_word(rng, _int_between(rng, 2, 3)) for _ in range(_WORD_COUNT)))


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
    verb, noun, other = _pick(rng, v.verbs), _pick(rng, v.nouns), _pick(rng, v.nouns)
    return (f"- {v.code}_{verb}_{noun}({_pick(rng, v.words)}: str, {_pick(rng, v.words)}: int = "
            f"{_int_between(rng, 1, 512)}) -> {v.cls(rng)}: {verb}s the {noun} of a {v.code} {other}.")


def _map_line(v: _Vocabulary, rng: random.Random) -> str:
    return (f"{v.module(rng)}: class {v.cls(rng)}({v.cls(rng)}) {_pick(rng, v.verbs)}s "
            f"{_pick(rng, v.nouns)}; defs {v.method(rng)}(), {v.method(rng)}({_pick(rng, v.words)}), "
            f"{v.method(rng)}({_pick(rng, v.words)}, {_pick(rng, v.nouns)}) [{_int_between(rng, 12, 900)} lines]")


def _lines_until(lines: list[str], target: int, count: TokenCounter, more: Callable[[], str]) -> str:
    """Append ``more()`` lines until the text reaches ``target`` tokens, then cut to it."""
    text = "\n".join(lines)
    while (used := count(text)) < target:
        while used < target:  # counted per line (cheap); the whole text is recounted after
            line = more()
            lines.append(line)
            used += count(line) + 1
        text = "\n".join(lines)
    while len(lines) > 1 and count(text) > target:  # the counter is additive to a token or so per line
        overshoot = count(text) - target
        last = lines.pop()
        keep = max(0, len(last) - math.ceil(overshoot * len(last) / max(count(last), 1)))
        if keep:
            lines.append(last[:keep])
        text = "\n".join(lines)
    return text


def prefix_target_tokens(config: RepositoryAssistantConfig, repository: int) -> int:
    """The length drawn for ``repository``'s prefix, in tokens."""
    return _int_between(_rng(config.seed, "prefix-length", repository),
                        config.prefix_min_tokens, config.prefix_max_tokens)


def repository_prefix(config: RepositoryAssistantConfig, repository: int,
                      count_tokens: TokenCounter | None = None) -> str:
    """The shared system turn of ``repository``: prompt, tools, then the repository map."""
    count = count_tokens or approx_tokens
    v = _vocabulary(config.seed, repository)
    rng = _rng(config.seed, "prefix-text", repository)
    lines = _header(v) + [_tool_line(v, rng) for _ in range(6)] + ["", f"# {v.code} map"]
    return _lines_until(lines, prefix_target_tokens(config, repository), count, lambda: _map_line(v, rng))


def repository_prefixes(config: RepositoryAssistantConfig, count_tokens: TokenCounter | None = None) -> list[str]:
    return [repository_prefix(config, r, count_tokens) for r in range(config.repositories)]


# ---------------------------------------------------------------- questions


def _question(v: _Vocabulary, rng: random.Random, target: int, limit: int, count: TokenCounter) -> str:
    openers = (
        lambda: f"In {v.code}, where is {v.cls(rng)} defined, and who calls {v.method(rng)}()?",
        lambda: f"Why would {v.method(rng)}({_pick(rng, v.words)}) in {v.module(rng)} return None?",
        lambda: f"What does {v.cls(rng)}.{v.method(rng)} do with its {_pick(rng, v.nouns)}?",
        lambda: f"Which {v.code} tool should I use to {_pick(rng, v.verbs)} a {_pick(rng, v.nouns)}?",
        lambda: f"Is {v.module(rng)} safe to call from two threads at once?",
    )
    extras = (
        lambda: f" Assume {_pick(rng, v.words)} is {_int_between(rng, 0, 999)}.",
        lambda: f" Mention {v.cls(rng)} if it matters.",
        lambda: f" Compare it with {v.method(rng)}().",
        lambda: f" I am on the {_pick(rng, v.words)} branch.",
        lambda: " Keep it short.",
    )
    text = _pick(rng, openers)()
    for _ in range(64):  # extras that would pass ``limit`` are skipped; "Keep it short." nearly always fits
        if count(text) >= target:
            break
        longer = text + _pick(rng, extras)()
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
    weights = zipf_weights(config.repositories, config.zipf_exponent)
    cumulative = [sum(weights[:k + 1]) for k in range(len(weights))]
    schedule = _rng(config.seed, "schedule")
    requests, now = [], 0.0
    for index in range(config.requests):
        now += _exponential(schedule, config.rate)
        repository = min(bisect.bisect_right(cumulative, schedule.random() * cumulative[-1]),
                         config.repositories - 1)
        if repository not in prefixes:
            prefixes[repository] = repository_prefix(config, repository, count_tokens)
        rng = _rng(config.seed, "question", index)
        target = _int_between(rng, config.question_min_tokens, config.question_max_tokens)
        question = _question(_vocabulary(config.seed, repository), rng, target, config.question_max_tokens, count)
        messages = [{"role": "system", "content": prefixes[repository]}, {"role": "user", "content": question}]
        requests.append(WorkloadRequest(index, now, repository, messages, config.max_tokens))
    return requests


# ---------------------------------------------------------------- token counts (optional)


def _default_model_dir() -> Path:
    from kvroute.model_prep import model_dir
    return model_dir()


def load_tokenizer(model: str | Path | None = None):
    """The model's Hugging Face tokenizer (default: the prepared SmolLM2 folder). Needs transformers."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model or _default_model_dir()))


def tokenizer_counter(tokenizer) -> TokenCounter:
    """A ``count_tokens`` for the generators: plain text tokens, no special tokens."""
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_tokens(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> int:
    """Tokens of ``messages`` after the chat template, as the orchestrator will count them."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return len(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def estimate_prefix_tokens(prefixes: Sequence[str], tokenizer=None) -> list[int]:
    """Tokens of each prefix as a templated system turn: the part requests for the same
    repository share. With ``tokenizer=None`` the model's tokenizer is loaded."""
    tokenizer = tokenizer or load_tokenizer()
    return [prompt_tokens(tokenizer, [{"role": "system", "content": p}], add_generation_prompt=False)
            for p in prefixes]
