"""The prefill work queued on this worker, request by request, for its heartbeats.

A request counts from its acceptance to its first output. What it still costs is its
prompt minus what the engine will not compute: the tokens a KV pull brings, and the
leading blocks already resident in the prefix cache (a hit, or chunks of its own prompt
that vLLM has scheduled, since it stores a chunk's blocks when it schedules it). So a
warm request behind a cold one, or a long prefill half done, is not priced as a whole
cold prompt: the orchestrator's queue-wait estimate would otherwise send the next
request with that prefix elsewhere, to recompute it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from foundation import wire
from worker.resident import PrefixProgress, ResidentBlocks


def tokens_to_compute(request: wire.GenerateRequest, cached_tokens: int = 0) -> int:
    """Prompt tokens this worker's engine will compute for ``request``, with
    ``cached_tokens`` of its prompt resident here. The tokens a KV pull brings are not
    prefill work: counting them made a decode worker look seconds busy in every heartbeat
    sent while a handed-off request waited for its blocks. The engine recomputes the last
    prompt token even on a full hit, to sample from it."""
    prompt = len(request.prompt_token_ids)
    pulled = request.pull_from.num_tokens if request.pull_from is not None else 0
    return max(0, prompt - max(pulled, min(cached_tokens, prompt - 1)))


@dataclass
class QueuedPrompt:
    request: wire.GenerateRequest
    progress: PrefixProgress = field(default_factory=PrefixProgress)
    accepted_at: float = field(default_factory=time.monotonic)

    def tokens_left(self, resident: ResidentBlocks) -> int:
        cached = resident.cached_prefix_tokens(self.request.prompt_token_ids, self.request.cache_salt,
                                               self.progress)
        return tokens_to_compute(self.request, cached)


def queued_prefill(prompts: Mapping[str, QueuedPrompt], resident: ResidentBlocks) -> dict[str, int]:
    """Request id → prompt tokens still to compute, for every request with no output yet."""
    return {request_id: prompt.tokens_left(resident) for request_id, prompt in prompts.items()}


def head_prompt_age(prompts: Mapping[str, QueuedPrompt], last_step_end: float, now: float) -> float:
    """Seconds the oldest queued prompt has computed since its listed tokens could last
    have changed: since the engine's last step ended, or since it was accepted if later.
    The engine serves the oldest first, and a prompt alone is one step, so this is the
    part of it already done (0 with nothing queued)."""
    oldest = next(iter(prompts.values()), None)
    if oldest is None:
        return 0.0
    return max(0.0, now - max(oldest.accepted_at, last_step_end))
