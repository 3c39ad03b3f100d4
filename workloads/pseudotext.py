"""Made-up words and sentences: deterministic pseudo-text that shares exactly what it should.

Words are built from syllables (onset + vowel, an optional coda at the end), so each
generator can draw its own vocabulary from a seeded stream: two vocabularies drawn from
different streams share few words, and texts built from them differ from the first word
on. ``index_word`` spells an integer as syllables, a word that no other index has.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

from workloads.base import TokenCounter, approx_tokens, fit_lines, int_between, pick, seeded_rng

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr",
           "kl", "pl", "st", "tr", "sh", "ch", "th")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_CODAS = ("", "", "", "n", "r", "s", "l", "x", "k", "m")
# one letter per onset and vowel, so the syllables of index_word never run together ambiguously
_INDEX_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_INDEX_VOWELS = ("a", "e", "i", "o", "u")


def made_up_word(rng: random.Random, syllables: int) -> str:
    return "".join(pick(rng, _ONSETS) + pick(rng, _VOWELS) for _ in range(syllables - 1)) + \
        pick(rng, _ONSETS) + pick(rng, _VOWELS) + pick(rng, _CODAS)


def index_word(index: int) -> str:
    """``index`` in base 70, one consonant-vowel syllable a digit: distinct for distinct indices."""
    base, syllables = len(_INDEX_ONSETS) * len(_INDEX_VOWELS), []
    while True:
        index, digit = divmod(index, base)
        syllables.append(_INDEX_ONSETS[digit // len(_INDEX_VOWELS)] + _INDEX_VOWELS[digit % len(_INDEX_VOWELS)])
        if index == 0:
            return "".join(reversed(syllables))


def vocabulary(rng: random.Random, size: int) -> tuple[str, ...]:
    """``size`` made-up words of one to three syllables."""
    return tuple(made_up_word(rng, int_between(rng, 1, 3)) for _ in range(size))


def sentence(rng: random.Random, words: Sequence[str], low: int = 5, high: int = 14) -> str:
    return " ".join(pick(rng, words) for _ in range(int_between(rng, low, high))).capitalize() + "."


def filler_text(rng: random.Random, words: Sequence[str], heading: str, target: int, count: TokenCounter) -> str:
    """``heading``, then sentences of ``words``, one a line, to ``target`` tokens (see ``fit_lines``)."""
    return fit_lines([heading], target, count, lambda: sentence(rng, words))


# A pure function of its arguments, and a simulated goodput search asks for the same texts at
# every rate it tries (a fifth of its time at 64 engines went to drawing them again).
@functools.lru_cache(maxsize=65_536)
def seeded_text(heading: str, target: int, count_tokens: TokenCounter | None, seed: int, *labels: object,
                words: int = 60) -> str:
    """``filler_text`` in a vocabulary of its own, both drawn from the stream ``(seed, *labels)``."""
    rng = seeded_rng(seed, *labels)
    return filler_text(rng, vocabulary(rng, words), heading, target, count_tokens or approx_tokens)
