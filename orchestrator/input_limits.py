"""Bounds on what one request may ask of the orchestrator, beyond its body size.

One HTTP request should cost about one request's work: ``/v1/completions`` fans a prompt
list out into one engine request per prompt, and every stop string is searched in every
chunk of output. The bounds come from ``OrchestratorSettings`` (defaults documented there
and in docs/security.md); going past one is a 400 that names the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.errors import APIError


@dataclass(frozen=True)
class InputLimits:
    max_prompts_per_request: int = 16
    max_stop_sequences: int = 4  # OpenAI's own limit
    max_stop_length: int = 256
    tokenize_in_thread_chars: int = 4096

    def check_prompt_count(self, count: int) -> None:
        if count > self.max_prompts_per_request:
            raise APIError(400, f"{count} prompts in one request; at most {self.max_prompts_per_request} "
                                f"(--max-prompts-per-request)", param="prompt", code="too_many_prompts")

    def check_stops(self, stops: list[str]) -> None:
        if len(stops) > self.max_stop_sequences:
            raise APIError(400, f"{len(stops)} stop sequences; at most {self.max_stop_sequences}",
                           param="stop", code="too_many_stop_sequences")
        longest = max(map(len, stops), default=0)
        if longest > self.max_stop_length:
            raise APIError(400, f"a stop sequence of {longest} characters; at most {self.max_stop_length}",
                           param="stop", code="stop_sequence_too_long")
