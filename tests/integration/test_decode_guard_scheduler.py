"""worker.decode_guard's scheduler is vLLM's own with the guard: driven step by step with the
prepared model's config, a long prompt that arrives while a stream decodes is computed in
capped pieces beside that stream's tokens, and takes whole steps once nothing decodes."""

from __future__ import annotations

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from foundation import wire
from foundation.model_prep import resolve_model
from worker.decode_guard import STEP_TOKENS_KEY, DecodeGuardScheduler, decode_guard_args
from worker.generation import sampling_params

BLOCK_SIZE = 32
STEP_TOKENS = 2048
CAP = 256
SAMPLED = 5


@pytest.fixture(scope="module")
def model_path() -> str:
    return resolve_model(None)


def new_scheduler(model_path: str, cap: int, tpot_target: float = 0.0, clock=None) -> Scheduler:
    config = VllmConfig(
        model_config=ModelConfig(model=model_path, dtype="float32", max_model_len=4096, enforce_eager=True),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=STEP_TOKENS, max_num_seqs=16, max_model_len=4096,
                                         is_encoder_decoder=False),
        additional_config=decode_guard_args(cap, tpot_target)["additional_config"])
    config.cache_config.num_gpu_blocks = 1000
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=1000, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    if cap < 0:  # vLLM's own
        return Scheduler(config, kv_cache_config, StructuredOutputManager(config), block_size=BLOCK_SIZE)
    return DecodeGuardScheduler(config, kv_cache_config, StructuredOutputManager(config), block_size=BLOCK_SIZE,
                                **({"clock": clock} if clock else {}))


def add(scheduler: Scheduler, request_id: str, prompt_tokens: int, max_tokens: int = 100,
        tpot_target: float = 0.0) -> None:
    first = 1000 + 7 * len(scheduler.requests)
    params = sampling_params(wire.GenerateRequest(
        request_id=request_id, prompt_token_ids=[], sampling=wire.SamplingSpec(max_tokens=max_tokens,
                                                                                tpot_target=tpot_target)))
    scheduler.add_request(Request(request_id=request_id, prompt_token_ids=list(range(first, first + prompt_tokens)),
                                  sampling_params=params, pooling_params=None, block_hasher=None))


def step(scheduler: Scheduler) -> dict[str, int]:
    """One engine step: what the scheduler hands the model, then a sampled token for every
    request whose prompt the step completes or that decodes."""
    return finish(scheduler, scheduler.schedule())


def finish(scheduler: Scheduler, output) -> dict[str, int]:
    ids = list(output.num_scheduled_tokens)
    sampled = [[SAMPLED] if scheduler.requests[i].num_computed_tokens >= scheduler.requests[i].num_prompt_tokens
               else [] for i in ids]
    scheduler.update_from_output(output, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={request_id: index for index, request_id in enumerate(ids)},
        sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={}, pooler_output=[]))
    return dict(output.num_scheduled_tokens)


def test_a_prompt_beside_a_decoding_stream_is_computed_in_capped_pieces(model_path):
    scheduler = new_scheduler(model_path, CAP)
    assert scheduler.vllm_config.additional_config[STEP_TOKENS_KEY] == CAP
    add(scheduler, "stream", 40)
    assert step(scheduler) == {"stream": 40}
    add(scheduler, "long", 3000)
    add(scheduler, "waiting", 500)
    steps = [step(scheduler) for _ in range(12)]
    # The stream gets a token every step; the long prompt 256 tokens a step; the waiting prompt
    # does not join in while the long one is under way.
    assert all(s["stream"] == 1 for s in steps), steps
    assert [s.get("long") for s in steps[:11]] == [CAP] * 11, steps
    assert all("waiting" not in s for s in steps[:11]), steps
    assert sum(s.get("long", 0) for s in steps) >= 3000
    # Then the waiting prompt, capped in turn, beside both streams.
    following = step(scheduler)
    assert following == {"stream": 1, "long": 1, "waiting": CAP}, following


def test_without_a_decoding_stream_a_prompt_takes_whole_steps(model_path):
    scheduler = new_scheduler(model_path, CAP)
    add(scheduler, "long", 3000)
    assert step(scheduler) == {"long": STEP_TOKENS}


@pytest.mark.parametrize("cap", [-1, 0])
def test_without_a_cap_or_target_a_decoding_stream_shares_whole_steps(model_path, cap):
    """vLLM's scheduler (-1), and this one with neither a fixed cap nor any target."""
    scheduler = new_scheduler(model_path, cap)
    add(scheduler, "stream", 40)
    step(scheduler)
    add(scheduler, "long", 3000)
    assert step(scheduler) == {"stream": 1, "long": STEP_TOKENS - 1}


class SteppedClock:
    """Engine time, moved by the test as steps compute."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("engine_target, request_target", [(0.15, 0.0), (0.0, 0.15), (0.9, 0.15)])
def test_a_time_per_token_target_sizes_steps_from_the_measured_pace(model_path, engine_target, request_target):
    """The stream's own target, else the engine's, sizes the steps beside it."""
    clock = SteppedClock()
    scheduler = new_scheduler(model_path, 0, tpot_target=engine_target, clock=clock)

    def timed_step() -> dict[str, int]:
        output = scheduler.schedule()
        clock.now += sum(output.num_scheduled_tokens.values()) / 2000.0  # 2,000 tokens a second
        return finish(scheduler, output)

    add(scheduler, "warm-up", 1024, max_tokens=1)  # nobody decodes: one whole step, timed
    assert timed_step() == {"warm-up": 1024}
    # One timed step moves the estimate a fifth of the way from its initial 1,000 to 2,000.
    assert scheduler.pace.tokens_per_second == pytest.approx(1200.0, rel=0.01)
    add(scheduler, "stream", 40, tpot_target=request_target)
    timed_step()  # its prompt and first token
    add(scheduler, "long", 3000)
    first = timed_step()
    # The stream's next token is due 0.15 s after its first: 180 prompt tokens at 1,200 a second.
    assert first["stream"] == 1 and first["long"] == pytest.approx(180, abs=2), first
