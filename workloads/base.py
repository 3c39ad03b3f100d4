"""What every workload generator shares: the request type, seeded randomness, token counts,
arrival processes and fitting text to a token length.

Only ``random.Random.random()`` is used, seeded per purpose from a SHA-256 of the seed and
a label (``seeded_rng``), so a generator's output is the same on every machine and Python
version, and one part of a workload (a repository's prefix, a tenant's instructions) does
not change when another part is asked for in a different size.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import math
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

TokenCounter = Callable[[str], int]

# Without a tokenizer, tokens are estimated from pieces: each word counts one token per
# started LETTERS_PER_TOKEN letters, each number, punctuation mark and newline one. On this
# pseudo-text that is within ~10% of SmolLM2's tokenizer (a little under it for prefixes,
# a little over it for questions); made-up identifiers split into ~2 characters a token.
LETTERS_PER_TOKEN = 3.0
_PIECES = re.compile(r"[A-Za-z][a-z]*|\d{1,3}|[^\sA-Za-z\d]|\n")


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: send ``messages`` at ``arrival_seconds`` after the start.

    ``group`` names what the request shares a prefix with, in the generator's own terms
    (a repository, a conversation, a tenant, a prompt group, a prefix); requests of
    different groups share at most a short common instruction. The optional fields are
    set by the generators they mean something to.
    """

    index: int
    arrival_seconds: float
    group: int
    messages: list[dict[str, str]]  # chat format: [{"role": "system", ...}, {"role": "user", ...}]
    max_tokens: int
    tenant: str | None = None  # rag: who asks; a replay may map it onto an API key
    turn: int | None = None  # support-chat: 0 for a conversation's first question

    @property
    def repository(self) -> int:
        """The repository-assistant workload's name for ``group``."""
        return self.group

    @property
    def prefix(self) -> str:
        """The shared system turn."""
        return self.messages[0]["content"]

    @property
    def question(self) -> str:
        return self.messages[-1]["content"]


def in_arrival_order(requests: Iterable[WorkloadRequest]) -> list[WorkloadRequest]:
    """Sorted by arrival (stable: ties keep their order) and numbered 0, 1, ... in that order."""
    ordered = sorted(requests, key=lambda request: request.arrival_seconds)
    return [dataclasses.replace(request, index=index) for index, request in enumerate(ordered)]


def approx_tokens(text: str) -> int:
    """Token count estimate without a tokenizer (see ``LETTERS_PER_TOKEN``)."""
    return sum(math.ceil(len(piece) / LETTERS_PER_TOKEN) if piece[0].isalpha() else 1
               for piece in _PIECES.findall(text))


# ---------------------------------------------------------------- randomness


def seeded_rng(seed: int, *labels: object) -> random.Random:
    """An independent stream per purpose: SHA-256 of the seed and labels seeds it."""
    digest = hashlib.sha256(repr((int(seed),) + labels).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def int_between(rng: random.Random, low: int, high: int) -> int:
    """Uniform in [low, high], from ``random()`` alone (stable across Python versions)."""
    return low + min(int(rng.random() * (high - low + 1)), high - low)


def pick(rng: random.Random, items: Sequence):
    return items[int_between(rng, 0, len(items) - 1)]


def shuffled(rng: random.Random, items: Sequence) -> list:
    """A Fisher-Yates shuffle from ``random()`` alone (``random.shuffle`` is not promised stable)."""
    out = list(items)
    for i in range(len(out) - 1, 0, -1):
        j = int_between(rng, 0, i)
        out[i], out[j] = out[j], out[i]
    return out


def exponential(rng: random.Random, rate: float) -> float:
    return -math.log(1.0 - rng.random()) / rate


def poisson_arrivals(rng: random.Random, rate: float) -> Iterator[float]:
    """Arrival times of a Poisson process (the first after one gap); ``rate=inf``: all at 0."""
    now = 0.0
    while True:
        if math.isfinite(rate):
            now += exponential(rng, rate)
        yield now


def zipf_weights(count: int, exponent: float) -> list[float]:
    """Normalised popularity of items 0..count-1: proportional to 1 / (rank + 1) ** exponent."""
    raw = [1.0 / (rank + 1) ** exponent for rank in range(count)]
    total = sum(raw)
    return [weight / total for weight in raw]


def zipf_cumulative(count: int, exponent: float) -> list[float]:
    return list(itertools.accumulate(zipf_weights(count, exponent)))


def pick_weighted(rng: random.Random, cumulative: Sequence[float]) -> int:
    """An index drawn with the probabilities whose running sums are ``cumulative``."""
    return min(bisect.bisect_right(cumulative, rng.random() * cumulative[-1]), len(cumulative) - 1)


# ---------------------------------------------------------------- text of a given length


def fit_lines(lines: list[str], target: int, count: TokenCounter, more: Callable[[], str]) -> str:
    """Append ``more()`` lines until the text reaches ``target`` tokens, then cut to it.

    The result has ``target`` tokens or a token or two fewer (the counter is additive to
    a token or so per line, and the last line is cut by characters), unless the first
    line alone is longer: it is never cut, so make it a short heading.
    """
    text = "\n".join(lines)
    while (used := count(text)) < target:
        while used < target:  # counted per line (cheap); the whole text is recounted after
            line = more()
            lines.append(line)
            used += count(line) + 1
        text = "\n".join(lines)
    while len(lines) > 1 and count(text) > target:  # the first line is kept whole
        overshoot = count(text) - target
        last = lines.pop()
        keep = max(0, len(last) - math.ceil(overshoot * len(last) / max(count(last), 1)))
        if keep:
            lines.append(last[:keep])
        text = "\n".join(lines)
    return text


# ---------------------------------------------------------------- config checks


def check_positive_rate(rate: float, what: str = "rate") -> None:
    """A Poisson rate: positive; ``math.inf`` means every request arrives at once."""
    if not rate > 0 or math.isnan(rate):
        raise ValueError(f"{what} must be a positive number of requests per second (inf: all at once)")


def check_at_least_one(**values: int) -> None:
    """Counts and lengths that must be >= 1, by field name."""
    small = [name for name, value in values.items() if value < 1]
    if small:
        raise ValueError(f"{', '.join(small)} must be >= 1")


def check_bounds(low: int, high: int, name: str) -> None:
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= {name}_min_tokens <= {name}_max_tokens")
