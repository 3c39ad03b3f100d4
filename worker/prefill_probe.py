"""A timed prefill at start-up, so that orchestrators price this worker's prefills from its
first request on.

The cost model's start-up defaults describe one machine; on another they can be an order
of magnitude off (measured here: 0.39 s expected for a 925-token prompt that took 6.1 s),
and until enough requests have been timed the planner places requests as if prefill
were that cheap. So before it serves, a worker prefills ``num_tokens`` tokens once
untimed (first forward passes of a shape run slower) and once timed, and reports the
timed one in its heartbeats (``wire.PrefillProbe``); an orchestrator feeds it to its
calibration when the worker registers (``orchestrator.startup_calibration``).

Both prompts carry salts of their own, so they share no block with each other or with any
tenant's prompt; the prefix cache is reset afterwards, so they leave nothing behind.
"""

from __future__ import annotations

import logging
import time
import uuid

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from foundation import wire
from worker.engine import reset_prefix_cache

logger = logging.getLogger("kvroute.worker.prefill_probe")
FIRST_TOKEN_ID = 1000  # clear of the special tokens at the start of most vocabularies
TOKEN_ID_SPAN = 20_000
RESET_ATTEMPTS = 10


def probe_prompt(num_tokens: int, salt: str) -> dict:
    """Deterministic ids that repeat no block-sized run; the salt keeps the cache apart."""
    return {"prompt_token_ids": [FIRST_TOKEN_ID + (i * 7919) % TOKEN_ID_SPAN for i in range(num_tokens)],
            "cache_salt": salt}


async def _prefill_seconds(engine, num_tokens: int) -> float:
    salt = f"kvroute-probe-{uuid.uuid4().hex}"
    params = SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    started = time.monotonic()
    async for _ in engine.generate(probe_prompt(num_tokens, salt), params, request_id=salt):
        pass
    return time.monotonic() - started


async def probe_prefill(engine, num_tokens: int) -> wire.PrefillProbe | None:
    """Time one cold prefill of ``num_tokens`` after an untimed one; None when disabled."""
    if num_tokens <= 0:
        return None
    await _prefill_seconds(engine, num_tokens)
    seconds = await _prefill_seconds(engine, num_tokens)
    if not await reset_prefix_cache(engine, RESET_ATTEMPTS):
        # harmless: salted blocks no prompt can match, evicted like any other
        logger.warning("the prefix cache kept the start-up probe's blocks")
    logger.info("start-up prefill probe: %d tokens in %.3f s", num_tokens, seconds)
    return wire.PrefillProbe(new_tokens=num_tokens, seconds=seconds)
