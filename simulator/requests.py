"""What the simulator replays: anything with an arrival time, a prompt of token ids and an
output length. Scaled trace requests (``workloads.trace.TraceRequest``) are that
already; workload requests (``workloads.WorkloadRequest``) carry chat
messages and are turned into token ids here.

With a tokenizer, a workload prompt is its chat template's token ids, exactly what the
orchestrator sends the engines. Without one, each message becomes a role marker plus
``approx_tokens(content)`` pseudo-random ids drawn from the content itself: equal texts
(a repository's shared system turn) give equal ids and different texts share nothing,
which is all a prefix cache can see.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from workloads import WorkloadRequest, approx_tokens
from workloads.tokens import pseudo_token_ids
from workloads.trace import ScaledTrace, TraceRequest

ROLE_MARKER_TOKENS = 3  # "<|im_start|>role\n", as SmolLM2's template frames a message


class ReplayRequest(Protocol):
    index: int
    arrival_seconds: float
    max_tokens: int
    prompt_tokens: int  # len(prompt_token_ids), known without making the ids

    @property
    def prompt_token_ids(self) -> list[int]: ...


@dataclass(frozen=True)
class TokenRequest:
    """A request whose prompt is already token ids."""

    index: int
    arrival_seconds: float
    max_tokens: int
    prompt_token_ids: list[int]

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@functools.lru_cache(maxsize=65_536)  # the same texts recur in every run of a goodput search
def _text_ids(label: str, text: str, count: int) -> tuple[int, ...]:
    return tuple(pseudo_token_ids(hashlib.sha256(f"{label}\x00{text}".encode()).digest(), count))


def pseudo_chat_tokens(messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids standing in for a templated chat, without a tokenizer (see the module docstring)."""
    tokens: list[int] = []
    for message in messages:
        tokens += _text_ids("role", message["role"], ROLE_MARKER_TOKENS)
        tokens += _text_ids("content", message["content"], approx_tokens(message["content"]))
    tokens += _text_ids("role", "assistant", ROLE_MARKER_TOKENS)
    return tokens


def workload_prompt(request: WorkloadRequest, tokenizer=None) -> list[int]:
    if tokenizer is None:
        return pseudo_chat_tokens(request.messages)
    encoded = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def replay_requests(source: ScaledTrace | Iterable, tokenizer=None) -> list[ReplayRequest]:
    """The requests of a scaled trace or a workload, in arrival order (ties keep their order)."""
    items = source.requests if isinstance(source, ScaledTrace) else list(source)
    requests = [_as_replay(item, tokenizer) for item in items]
    return sorted(requests, key=lambda request: request.arrival_seconds)


def _as_replay(item, tokenizer) -> ReplayRequest:
    if isinstance(item, (TraceRequest, TokenRequest)):
        return item
    if isinstance(item, WorkloadRequest):
        return TokenRequest(item.index, item.arrival_seconds, item.max_tokens, workload_prompt(item, tokenizer))
    raise TypeError(f"cannot replay a {type(item).__name__}: need a trace request, a workload request "
                    f"or a TokenRequest")
