"""What a replay sends: named workload generators and Mooncake traces turned into ``ReplayItem``s.

A workload's requests are chat messages and go to ``/v1/chat/completions``; a trace's are
token ids and go to ``/v1/completions`` as they are, because a chat template around them
would shift every block boundary and with it what the trace says is shared.

Workload lengths are estimated without a tokenizer (``workloads.approx_tokens``, within
~10% of SmolLM2's), so a replay needs nothing of the model on the client. Every request
goes with the replay's one API key: a workload request's ``tenant`` (rag) is carried in
the generator's output but not sent as a distinct key.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvroute.bench.replay import ReplayItem
from workloads import GENERATORS, WorkloadRequest, generate_named, parse_options
from workloads.trace import ScaledTrace, TraceRequest, TraceScaling, load_trace

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


@dataclass(frozen=True)
class WorkloadChoice:
    """How a replay overrides a generator's defaults; None keeps the generator's own.

    ``options`` are ``KEY=VALUE`` overrides of the generator's config fields
    (``workloads.registry``); ``requests`` and ``rate`` apply where the config has them,
    and ``requests`` otherwise keeps the first N requests.
    """

    requests: int | None = None
    rate: float | None = None
    seed: int = 0
    options: tuple[str, ...] = ()


def _generate(name: str, choice: WorkloadChoice) -> list[WorkloadRequest]:
    return generate_named(name, parse_options(choice.options), requests=choice.requests, rate=choice.rate,
                          seed=choice.seed)


# name → generator; ``kvroute bench replay --workload`` offers exactly these.
WORKLOADS: dict[str, Callable[[WorkloadChoice], list[WorkloadRequest]]] = {
    name: functools.partial(_generate, name) for name in GENERATORS
}


def workload_item(request: WorkloadRequest) -> ReplayItem:
    body = {"messages": request.messages, "max_tokens": request.max_tokens}
    return ReplayItem(request.index, request.arrival_seconds, CHAT_ENDPOINT, lambda: body, request.group)


def workload_items(name: str, choice: WorkloadChoice) -> list[ReplayItem]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return [workload_item(request) for request in WORKLOADS[name](choice)]


def trace_item(request: TraceRequest) -> ReplayItem:
    def payload() -> dict:
        return {"prompt": request.prompt_token_ids, "max_tokens": request.max_tokens}

    # The first hash id names the first block: requests that share it share a prefix.
    return ReplayItem(request.index, request.arrival_seconds, COMPLETIONS_ENDPOINT, payload, request.hash_ids[0])


def trace_items(path: str | Path, scaling: TraceScaling,
                limit: int | None = None) -> tuple[list[ReplayItem], ScaledTrace]:
    """The trace's first ``limit`` records, scaled; the ``ScaledTrace`` says how many were dropped."""
    scaled = load_trace(path, scaling, limit)
    return [trace_item(request) for request in scaled.requests], scaled
