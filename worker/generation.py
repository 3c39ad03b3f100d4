"""Turning a ``GenerateRequest`` into a vLLM call, and vLLM outputs into ``GenerateChunk``s."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind

from foundation import wire
from transfer.request_params import PARAMS_KEY
from worker.decode_guard import target_args


def sampling_params(request: wire.GenerateRequest) -> SamplingParams:
    spec = request.sampling
    return SamplingParams(
        max_tokens=spec.max_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        seed=spec.seed,
        min_tokens=spec.min_tokens,
        ignore_eos=spec.ignore_eos,
        stop_token_ids=list(spec.stop_token_ids),
        logprobs=spec.logprobs,
        detokenize=False,  # the orchestrator detokenizes the merged stream
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": {PARAMS_KEY: transfer_params(request)},
                    **target_args(spec.tpot_target)},
    )


def transfer_params(request: wire.GenerateRequest) -> dict:
    params: dict = {}
    if request.hold_blocks:
        params["hold_blocks"] = True
    if request.pull_from is not None:
        params["pull_from"] = wire.to_dict(request.pull_from)
    return params


def engine_prompt(request: wire.GenerateRequest) -> dict:
    prompt: dict = {"prompt_token_ids": list(request.prompt_token_ids)}
    if request.cache_salt:
        prompt["cache_salt"] = request.cache_salt
    return prompt


def to_chunk(request_id: str, output: RequestOutput) -> wire.GenerateChunk:
    completion = output.outputs[0]
    return wire.GenerateChunk(
        request_id=request_id,
        token_ids=list(completion.token_ids),
        finished=output.finished,
        finish_reason=completion.finish_reason if output.finished else None,
        num_prompt_tokens=len(output.prompt_token_ids or ()),
        num_cached_tokens=output.num_cached_tokens or 0,
        pull_source=pull_source(output),
        logprobs=_logprobs(completion.logprobs),
        num_tier_tokens=_connector_params(output).get("tier_tokens", 0),
        tier_seconds=_connector_params(output).get("tier_seconds", 0.0),
    )


def pull_source(output: RequestOutput) -> wire.PullSource | None:
    raw = _connector_params(output).get("pull_source")
    return wire.from_dict(raw, wire.PullSource) if raw else None


def _connector_params(output: RequestOutput) -> dict:
    """What the connector said about a finished request (transfer.connector_scheduler.request_finished)."""
    return (output.kv_transfer_params or {}).get(PARAMS_KEY) or {}


def _logprobs(positions) -> list[wire.TokenLogprobs] | None:
    if not positions:
        return None
    result = []
    for position in positions:
        ranked = sorted(position.items(), key=lambda item: item[1].logprob, reverse=True)
        result.append(wire.TokenLogprobs(token_ids=[t for t, _ in ranked],
                                         logprobs=[lp.logprob for _, lp in ranked]))
    return result
