"""Running decodes keep their pace while a prompt prefills on the same engine.

vLLM batches every running request's next token into each engine step beside up to
``max_num_batched_tokens`` prompt tokens (2,048 on CPU), so a stream that is decoding when a
long prompt arrives waits a whole 2,048-token step for each of its next tokens: on two cores
~2 s a token, where it takes ~25 ms alone. Over a short answer that stall is its time per
output token (a repository-assistant replay's TPOT P99: 586 ms on one kvroute engine, 562 ms on
one plain vLLM server, 120 ms where a separate engine decodes; docs/results.md).

While any request decodes, this scheduler caps the prompt tokens of a step, so the running
streams get a token every capped step, and a waiting prompt does not join a prompt under way
(it would make the step longer again): the step's budget is the cap plus one token per decoding
stream, and no one prompt takes more than the cap of it. With no request decoding the engine's
own budget holds, so prompts that only wait behind prompts are served as one plain vLLM server
serves them. The cap follows each decoding request's TPOT target, which the orchestrator sends
with it (``wire.SamplingSpec.tpot_target``; ``--decoding-tpot-target S`` for requests that
carry none): a stream's next token is due its target a token after its first (its average,
which is what a client's TPOT measures), and a step may take as long as the stream closest to
its due time can wait, at least that stream's target, in prompt tokens at the engine's own
measured prefill speed. A stream ahead of its average thus lets a prompt take a long step; one
that has fallen behind keeps steps to its target. ``--decoding-step-tokens N`` fixes the cap
instead. Prefill speed barely depends on step size here (a 2,560-token prompt alone: 2.63-3.05
s at every size from 256 to 2,048 tokens, bfloat16, 2 cores), so the cap costs a prompt only
the streams' tokens computed before its own (measured in docs/operations.md).

The engine core process builds this scheduler from vLLM's ``scheduler_cls``; the worker's
settings travel in the engine's ``additional_config``, a request's target in its sampling
parameters' ``extra_args``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from vllm.v1.core.sched.scheduler import Scheduler

STEP_TOKENS_KEY = "kvroute_decoding_step_tokens"
TPOT_TARGET_KEY = "kvroute_decoding_tpot_target"
# A request's own target, in its SamplingParams.extra_args (worker.generation), taken only
# within (0, MAX_TPOT_TARGET_SECONDS], the bound the orchestrator puts on what a request asks.
TPOT_TARGET_ARG = "kvroute_tpot_target"
MAX_TPOT_TARGET_SECONDS = 10.0
SCHEDULER_CLASS = f"{__name__}.DecodeGuardScheduler"
# Prompt tokens a second assumed before the engine has timed a step of at least
# MEASURED_STEP_TOKENS of them (the worker's start-up probe is usually that step).
INITIAL_PREFILL_TOKENS_PER_SECOND = 1000.0
MEASURED_STEP_TOKENS = 64
PACE_WEIGHT = 0.2  # of each newly timed step in the running estimate
# The least a capped step computes of a prompt, so that a prompt always moves.
MIN_STEP_TOKENS = 32


def target_args(tpot_target: float) -> dict:
    """``extra_args`` that carry a request's target to this scheduler; none for 0, or for a
    value out of bounds (not finite, negative, beyond MAX_TPOT_TARGET_SECONDS)."""
    return {TPOT_TARGET_ARG: tpot_target} if 0 < tpot_target <= MAX_TPOT_TARGET_SECONDS else {}


def decoding_requests(running) -> int:
    """Requests in ``running`` past their prompt: each needs one token this step."""
    return sum(1 for request in running if request.num_computed_tokens >= request.num_prompt_tokens)


def step_limits(cap: int, decoding: int, budget: int, per_prompt: int) -> tuple[int, int]:
    """(step budget, most prompt tokens per request) for a step with ``decoding`` streams
    running, from the engine's own ``budget`` and ``per_prompt`` cap (0: none)."""
    if cap <= 0 or decoding == 0:
        return budget, per_prompt
    return min(budget, cap + decoding), min(cap, per_prompt) if per_prompt > 0 else cap


class PrefillPace:
    """Prompt tokens a second this engine computes, from the steps it times."""

    def __init__(self, tokens_per_second: float = INITIAL_PREFILL_TOKENS_PER_SECOND):
        self.tokens_per_second = tokens_per_second

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens >= MEASURED_STEP_TOKENS and seconds > 0:
            self.tokens_per_second += PACE_WEIGHT * (prompt_tokens / seconds - self.tokens_per_second)


class StreamDeadlines:
    """When each decoding stream's next token is due: its target, seconds a token, after its
    first (the request's own, else ``default_target``; 0: the stream sets no due time)."""

    def __init__(self, default_target: float = 0.0):
        self.default_target = default_target
        self._due: dict[str, tuple[float, float]] = {}  # request id -> (first token at, target)

    def target_of(self, request) -> float:
        extra = request.sampling_params.extra_args if request.sampling_params is not None else None
        return float((extra or {}).get(TPOT_TARGET_ARG) or self.default_target)

    def observe(self, requests: Iterable, now: float) -> None:
        """Note the first token of any of ``requests`` that has just produced it."""
        for request in requests:
            if request.num_output_tokens >= 1 and request.request_id not in self._due:
                target = self.target_of(request)
                if target > 0:
                    self._due[request.request_id] = (now, target)

    def forget_all_but(self, request_ids) -> None:
        for request_id in [known for known in self._due if known not in request_ids]:
            del self._due[request_id]

    def step_seconds(self, running: Iterable, now: float) -> float | None:
        """How long the next step may take: until the earliest due token among ``running``, each
        stream allowing at least its own target; None when no stream with a target decodes."""
        allowed = []
        for request in running:
            due = self._due.get(request.request_id)
            if due is not None:
                first, target = due
                allowed.append(max(first + target * request.num_output_tokens - now, target))
        return min(allowed) if allowed else None


def tpot_step_tokens(step_seconds: float | None, pace: PrefillPace, budget: int) -> int:
    """A step's prompt tokens for ``step_seconds`` of prefill (0: nobody decodes, no cap)."""
    if step_seconds is None:
        return 0
    return min(budget, max(MIN_STEP_TOKENS, int(step_seconds * pace.tokens_per_second)))


def prompt_tokens_of(num_scheduled_tokens: dict[str, int]) -> int:
    """Prompt tokens of a step: every request given more than its one next token."""
    return sum(tokens for tokens in num_scheduled_tokens.values() if tokens > 1)


class DecodeGuardScheduler(Scheduler):
    """vLLM's scheduler with each step's prompt tokens capped while requests decode."""

    def __init__(self, vllm_config, *args, clock: Callable[[], float] = time.monotonic, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        extra = vllm_config.additional_config
        self.fixed_step_tokens = int(extra.get(STEP_TOKENS_KEY, 0))
        self.deadlines = StreamDeadlines(float(extra.get(TPOT_TARGET_KEY, 0.0)))
        self.pace = PrefillPace()
        self._clock = clock
        self._step_started_at = 0.0

    def _step_cap(self, now: float) -> int:
        if self.fixed_step_tokens:
            return self.fixed_step_tokens
        return tpot_step_tokens(self.deadlines.step_seconds(self.running, now), self.pace,
                                self.max_num_scheduled_tokens)

    def schedule(self, *args, **kwargs):
        now = self._clock()
        self._step_started_at = now
        config = self.scheduler_config
        budget, per_prompt = self.max_num_scheduled_tokens, config.long_prefill_token_threshold
        self.max_num_scheduled_tokens, config.long_prefill_token_threshold = step_limits(
            self._step_cap(now), decoding_requests(self.running), budget, per_prompt)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens, config.long_prefill_token_threshold = budget, per_prompt

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        now = self._clock()
        self.pace.observe(prompt_tokens_of(scheduler_output.num_scheduled_tokens), now - self._step_started_at)
        self.deadlines.observe((self.requests[request_id] for request_id in scheduler_output.num_scheduled_tokens
                                if request_id in self.requests), now)
        self.deadlines.forget_all_but(self.requests)
        return outputs


def decode_guard_args(decoding_step_tokens: int, decoding_tpot_target: float = 0.0,
                      cuda_available: bool = False) -> dict:
    """The engine arguments of this scheduler: a fixed cap, or requests' own targets with
    ``decoding_tpot_target`` for those that carry none. None on GPUs: vLLM schedules a GPU
    engine's steps asynchronously (its ``AsyncScheduler``), which a ``scheduler_cls`` would turn
    off, and a GPU's steps are far shorter than the CPU's seconds this guards against; vLLM's
    CPU platform always schedules synchronously."""
    if cuda_available:
        return {}
    return {"scheduler_cls": SCHEDULER_CLASS,
            "additional_config": {STEP_TOKENS_KEY: decoding_step_tokens, TPOT_TARGET_KEY: decoding_tpot_target}}


def decode_guard_summary(additional_config: dict) -> str:
    """What an engine built with ``additional_config`` does beside decoding requests, for its log."""
    if STEP_TOKENS_KEY not in additional_config:
        return "vLLM's own (whole steps; a GPU engine)"
    if additional_config[STEP_TOKENS_KEY]:
        return f"at most {additional_config[STEP_TOKENS_KEY]} prompt tokens"
    fallback = additional_config[TPOT_TARGET_KEY]
    return ("as many prompt tokens as keep each stream at its TPOT target"
            + (f" ({fallback:g} s a token without one)" if fallback else " (none without one: whole steps)"))
