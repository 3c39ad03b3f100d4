"""Table test of the worker RPC's request validation (and its error classification)."""

from __future__ import annotations

import pytest

from foundation import wire
from worker.queued_prefill import tokens_to_compute
from worker.rpc_server import error_code, validate


def request(prompt=(1, 2, 3), **sampling) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id="r", prompt_token_ids=list(prompt),
                                sampling=wire.SamplingSpec(**sampling))


VALID = [
    pytest.param(request(), id="defaults"),
    pytest.param(request(prompt=[0]), id="token-zero"),
    pytest.param(request(prompt=[7]), id="single-token"),
    pytest.param(request(prompt=range(4096)), id="long-prompt"),
    pytest.param(request(prompt=[151_000, 2**31]), id="large-ids"),
    pytest.param(request(max_tokens=1), id="max-tokens-one"),
    pytest.param(request(max_tokens=100_000), id="max-tokens-large"),
    pytest.param(request(max_tokens=5, min_tokens=5, ignore_eos=True, stop_token_ids=[2], seed=1, logprobs=3),
                 id="all-sampling-fields"),
    pytest.param(wire.GenerateRequest(request_id="r", prompt_token_ids=[1], hold_blocks=True), id="producer"),
    pytest.param(wire.GenerateRequest(request_id="r", prompt_token_ids=[1, 2], cache_salt="t",
                                      pull_from=wire.PullSource(handle="h" * 32, address="tcp://p:1",
                                                                num_tokens=2, block_size=16)), id="consumer"),
]


@pytest.mark.parametrize("generate", VALID)
def test_valid_requests_pass(generate):
    assert validate(generate) is None


INVALID = [
    pytest.param(request(prompt=[]), "prompt_token_ids is empty", id="empty-prompt"),
    pytest.param(request(prompt=[-1]), "prompt_token_ids contains a negative id", id="negative-only"),
    pytest.param(request(prompt=[5, 6, -7, 8]), "prompt_token_ids contains a negative id", id="negative-inside"),
    pytest.param(request(prompt=[1, -(2**40)]), "prompt_token_ids contains a negative id", id="very-negative"),
    pytest.param(request(max_tokens=0), "max_tokens must be at least 1", id="max-tokens-zero"),
    pytest.param(request(max_tokens=-3), "max_tokens must be at least 1", id="max-tokens-negative"),
    # The first problem found is the one reported.
    pytest.param(request(prompt=[], max_tokens=0), "prompt_token_ids is empty", id="empty-and-max-tokens"),
    pytest.param(request(prompt=[-1], max_tokens=0), "prompt_token_ids contains a negative id",
                 id="negative-and-max-tokens"),
]


@pytest.mark.parametrize("generate, problem", INVALID)
def test_invalid_requests_are_refused_with_a_reason(generate, problem):
    assert validate(generate) == problem


def test_validate_after_decoding_from_the_wire():
    """Validation sees what a client sent: a decoded frame, defaults filled in."""
    frame = wire.encode(wire.GenerateRequest(request_id="r", prompt_token_ids=[3], sampling=wire.SamplingSpec(
        max_tokens=0)))
    assert validate(wire.decode(frame)) == "max_tokens must be at least 1"
    assert validate(wire.decode(wire.encode(request()))) is None


@pytest.mark.parametrize("error, code", [
    pytest.param(ValueError("bad temperature"), "invalid_request", id="value-error"),
    pytest.param(TypeError("bad type"), "invalid_request", id="type-error"),
    pytest.param(wire.WireError("malformed"), "invalid_request", id="wire-error"),
    pytest.param(RuntimeError("engine died"), "engine_error", id="runtime-error"),
    pytest.param(KeyError("x"), "engine_error", id="key-error"),
])
def test_error_code(error, code):
    assert error_code(error) == code


@pytest.mark.parametrize("prompt_tokens, pulled, expected", [
    (925, None, 925),  # computed here in full
    (926, 925, 1),  # a handed-off request: only the tail after the pulled KV
    (10, 16, 0),  # a pull source longer than the prompt never counts negative
])
def test_queued_prefill_counts_only_tokens_the_engine_computes(prompt_tokens, pulled, expected):
    source = None if pulled is None else wire.PullSource(handle="h" * 32, address="tcp://p:1",
                                                         num_tokens=pulled, block_size=128)
    generate = wire.GenerateRequest(request_id="r", prompt_token_ids=list(range(prompt_tokens)), pull_from=source)
    assert tokens_to_compute(generate) == expected
