"""The **support-chat** workload: multi-turn conversations with a support desk, whose
history grows turn by turn::

    turn 0:  [system: desk prompt]  [user: q0]                                  max_tokens
    turn 1:  [system: desk prompt]  [user: q0]  [assistant: a0]  [user: q1]     max_tokens
    turn k:  turn k-1's messages + [assistant: a(k-1)] + [user: qk]

so turn k's templated prompt starts with turn k-1's whole prompt (its generation prompt
included), and a conversation's next turn can reuse every block of its last one.

* conversations: ``conversations`` of them, each of ``turns_min``..``turns_max`` turns,
  starting as a Poisson process of ``rate`` conversations per second, so several are open
  at once and their turns interleave;
* think time between a conversation's turns: ``think_seconds_min`` plus an exponential
  gap, ``think_seconds_mean`` on average in all. The replay is open loop: a turn is sent
  on its schedule even if the last one has not finished, so keep the think time above
  the expected end-to-end latency;
* lengths: the desk prompt is ``system_tokens`` (the same in every conversation); each
  question ``question_min_tokens``..``question_max_tokens``; each assistant reply in the
  history ``reply_min_tokens``..``reply_max_tokens`` of pseudo-text, standing in for the
  model's answer, which an open-loop replay cannot know in advance.

Stresses: delta reuse and delta transfer: the best worker for turn k is the one that
served turn k-1 (it holds all but the newest question and reply), and a policy that
scatters a conversation recomputes a history that keeps growing. ``group`` is the
conversation, ``turn`` the turn (0-based). A conversation depends on the seed, its
index and the length bounds only.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from workloads.base import (
    TokenCounter,
    WorkloadRequest,
    approx_tokens,
    check_at_least_one,
    check_bounds,
    check_positive_rate,
    exponential,
    in_arrival_order,
    int_between,
    poisson_arrivals,
    seeded_rng,
)
from workloads.pseudotext import filler_text, index_word, seeded_text, vocabulary


@dataclass(frozen=True)
class SupportChatConfig:
    conversations: int = 24
    rate: float = 0.5  # conversations started per second (Poisson)
    turns_min: int = 2
    turns_max: int = 6
    system_tokens: int = 400
    question_min_tokens: int = 15
    question_max_tokens: int = 60
    reply_min_tokens: int = 40
    reply_max_tokens: int = 160
    think_seconds_min: float = 2.0
    think_seconds_mean: float = 8.0
    max_tokens: int = 16
    seed: int = 0

    def __post_init__(self):
        if self.conversations < 0 or not 1 <= self.turns_min <= self.turns_max:
            raise ValueError("need conversations >= 0 and 1 <= turns_min <= turns_max")
        check_positive_rate(self.rate)
        check_at_least_one(system_tokens=self.system_tokens, max_tokens=self.max_tokens)
        check_bounds(self.question_min_tokens, self.question_max_tokens, "question")
        check_bounds(self.reply_min_tokens, self.reply_max_tokens, "reply")
        if not 0 <= self.think_seconds_min <= self.think_seconds_mean or not math.isfinite(self.think_seconds_mean):
            raise ValueError("need 0 <= think_seconds_min <= think_seconds_mean < inf")


def desk_prompt(config: SupportChatConfig, count_tokens: TokenCounter | None = None) -> str:
    """The support desk's system prompt, shared by every conversation."""
    return seeded_text(f"You are the support desk of {index_word(config.seed).capitalize()}.", config.system_tokens,
                       count_tokens, config.seed, "support-desk")


def _think_seconds(rng: random.Random, config: SupportChatConfig) -> float:
    extra = config.think_seconds_mean - config.think_seconds_min
    return config.think_seconds_min + (exponential(rng, 1 / extra) if extra > 0 else 0.0)


def conversation(config: SupportChatConfig, number: int, start_seconds: float, system: str,
                 count_tokens: TokenCounter | None = None) -> list[WorkloadRequest]:
    """One conversation's turns; ``index`` is left at -1 until the turns of all are merged."""
    count = count_tokens or approx_tokens
    rng = seeded_rng(config.seed, "conversation", number)
    words = vocabulary(rng, 40)  # the customer's own product names, order codes, complaints
    history = [{"role": "system", "content": system}]
    turns, now = [], start_seconds
    for turn in range(int_between(rng, config.turns_min, config.turns_max)):
        heading = f"Ticket {index_word(number)}, message {turn + 1}:"
        target = int_between(rng, config.question_min_tokens, config.question_max_tokens)
        messages = history + [{"role": "user", "content": filler_text(rng, words, heading, target, count)}]
        turns.append(WorkloadRequest(-1, now, number, messages, config.max_tokens, turn=turn))
        target = int_between(rng, config.reply_min_tokens, config.reply_max_tokens)
        history = messages + [{"role": "assistant", "content": filler_text(rng, words, "Thanks.", target, count)}]
        now += _think_seconds(rng, config)
    return turns


def generate_support_chat(config: SupportChatConfig,
                          count_tokens: TokenCounter | None = None) -> list[WorkloadRequest]:
    """Every turn of every conversation, in arrival order."""
    system = desk_prompt(config, count_tokens)
    starts = poisson_arrivals(seeded_rng(config.seed, "conversation-starts"), config.rate)
    turns = [turn for number, start in zip(range(config.conversations), starts)
             for turn in conversation(config, number, start, system, count_tokens)]
    return in_arrival_order(turns)  # stable: simultaneous turns stay in conversation order
