"""Running decodes keep their pace while a prompt prefills on the same engine.

vLLM batches every running request's next token into each engine step beside up to
``max_num_batched_tokens`` prompt tokens (2,048 on CPU), so a stream that is decoding when a
long prompt arrives waits a whole 2,048-token step for each of its next tokens: on two cores
~1.3 s a token, where it takes ~25 ms alone. Over a short answer that stall is its time per
output token (a repository-assistant replay's TPOT P99: 535 ms on one kvroute engine, 501 ms on
one plain vLLM server, 120 ms where a separate engine decodes; docs/results.md).

With ``--decoding-step-tokens N`` a step computes at most N prompt tokens while any request
decodes, so the running streams get a token every N-token step, and a waiting prompt does not
join a prompt under way (it would make the step longer again): the step's budget is N plus one
token per decoding request, and no one prompt takes more than N of it. With no request
decoding the engine's own budget holds, so prompts that only wait behind prompts are served as
one plain vLLM server serves them. The price is the prompt's own prefill, computed in N-token
pieces while it overlaps decodes (measured in docs/operations.md).

The engine core process builds this scheduler from vLLM's ``scheduler_cls``; N travels in the
engine's ``additional_config`` under ``CONFIG_KEY``.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

CONFIG_KEY = "kvroute_decoding_step_tokens"
SCHEDULER_CLASS = f"{__name__}.DecodeGuardScheduler"


def decoding_requests(running) -> int:
    """Requests in ``running`` past their prompt: each needs one token this step."""
    return sum(1 for request in running if request.num_computed_tokens >= request.num_prompt_tokens)


def step_limits(cap: int, decoding: int, budget: int, per_prompt: int) -> tuple[int, int]:
    """(step budget, most prompt tokens per request) for a step with ``decoding`` streams
    running, from the engine's own ``budget`` and ``per_prompt`` cap (0: none)."""
    if cap <= 0 or decoding == 0:
        return budget, per_prompt
    return min(budget, cap + decoding), min(cap, per_prompt) if per_prompt > 0 else cap


class DecodeGuardScheduler(Scheduler):
    """vLLM's scheduler with each step's prompt tokens capped while requests decode."""

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        self.decoding_step_tokens = int(vllm_config.additional_config.get(CONFIG_KEY, 0))

    def schedule(self, *args, **kwargs):
        config = self.scheduler_config
        budget, per_prompt = self.max_num_scheduled_tokens, config.long_prefill_token_threshold
        self.max_num_scheduled_tokens, config.long_prefill_token_threshold = step_limits(
            self.decoding_step_tokens, decoding_requests(self.running), budget, per_prompt)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens, config.long_prefill_token_threshold = budget, per_prompt


def decode_guard_args(decoding_step_tokens: int) -> dict:
    """The engine arguments that cap prompt tokens per step while requests decode; none at 0."""
    if decoding_step_tokens <= 0:
        return {}
    return {"scheduler_cls": SCHEDULER_CLASS, "additional_config": {CONFIG_KEY: decoding_step_tokens}}
