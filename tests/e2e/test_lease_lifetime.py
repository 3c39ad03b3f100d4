"""A lease's life on a real prefill worker: it is servable as soon as the engine's next
step starts, however long that step computes, and when no decode worker pulls it, it
expires and frees the held blocks, whether it was staged to host memory or held in the
engine.

The worker runs with a short lease and a staging budget of a few blocks, so a short
prompt's lease is staged (the engine goes idle at once) and a long one's stays in place
(the engine keeps its blocks until the lease ends). Each test ends with nothing left
behind: no lease, no staged bytes, every engine block free again.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import zmq

from foundation import wire
from foundation.endpoint_client import PullFailed, fetch_transfer_stats, release_lease
from orchestrator.worker_client import WorkerClient
from tests.cluster import START_TIMEOUT, collect, start_worker, wait_idle, wait_staged
from transfer.block_client import pull_blocks

LEASE_SECONDS = 3.0
STAGING_GIB = 0.03  # five blocks of SmolLM2 in float32 (5.9 MB each)
STAGED_BLOCKS, IN_PLACE_BLOCKS = 3, 8
STEP_TOKENS = 512  # short engine steps, so the step-boundary test takes seconds, not a minute
BLOCK_TOKENS = 128  # the block counts and the staging budget above are in blocks of this size


@pytest.fixture(scope="module")
def producer(tmp_path_factory):
    worker = start_worker("prefill", tmp_path_factory.mktemp("lease-expiry"), "0",
                          ["--lease-seconds", str(LEASE_SECONDS), "--lease-staging-gib", str(STAGING_GIB),
                           "--step-tokens", str(STEP_TOKENS), "--block-size", str(BLOCK_TOKENS)])
    try:
        worker.wait_ready(START_TIMEOUT)
        yield worker
    finally:
        worker.stop()


@pytest.fixture
async def client(producer):
    client = WorkerClient(producer.rpc_address)
    yield client
    await client.close()


def prompt_of(blocks: int, first_token: int) -> list[int]:
    """A prompt that fills ``blocks - 1`` blocks and part of one more, unlike any other test's."""
    return [first_token + i % 5000 for i in range((blocks - 1) * BLOCK_TOKENS + 40)]


async def hold_unpulled(client: WorkerClient, request_id: str, prompt: list[int]) -> wire.PullSource:
    chunks = [c async for c in client.generate(wire.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, hold_blocks=True,
        sampling=wire.SamplingSpec(max_tokens=1, temperature=0.0)))]
    source = chunks[-1].pull_source
    assert source is not None and source.num_tokens == len(prompt), chunks[-1]
    assert math.ceil(source.num_tokens / source.block_size) == len(prompt) // BLOCK_TOKENS + 1
    return source


async def wait_granted(client: WorkerClient, timeout: float = 10.0) -> wire.WorkerStats:
    """The grant reaches the endpoint at the start of the engine's next step."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await client.stats()
        if stats.transfer.active_leases == 1:
            return stats
        assert time.monotonic() < deadline, f"the lease was never granted: {stats.transfer}"
        await asyncio.sleep(0.05)


async def wait_lease_ended(client: WorkerClient, expired_before: int, timeout: float) -> wire.WorkerStats:
    deadline = time.monotonic() + timeout
    while True:
        stats = await client.stats()
        if stats.transfer.leases_expired > expired_before and stats.transfer.active_leases == 0:
            return stats
        assert time.monotonic() < deadline, f"the lease never expired: {stats.transfer}"
        await asyncio.sleep(0.1)


async def wait_all_blocks_free(client: WorkerClient, timeout: float = 10.0) -> wire.WorkerStats:
    """Poll until the engine reports every block free; return its stats (the last seen on timeout).

    A lease ends on the transfer endpoint's thread, and the engine frees its blocks at its next
    step, whose load reaches the worker's stats after that: a few milliseconds later, longer on a
    busy machine."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await wait_idle(client)
        if stats.load.num_free_blocks == stats.load.num_total_blocks or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def assert_back_to(client: WorkerClient, before: wire.WorkerStats) -> wire.WorkerStats:
    """Nothing left behind: one expiry, no other release, nothing staged, every block free."""
    after = await wait_all_blocks_free(client)
    assert after.transfer.active_leases == 0 and after.transfer.staged_bytes == 0, after.transfer
    assert after.transfer.leases_expired == before.transfer.leases_expired + 1, after.transfer
    assert after.transfer.leases_released == before.transfer.leases_released, after.transfer
    assert after.load.num_free_blocks == before.load.num_free_blocks == after.load.num_total_blocks, after.load
    return after


async def test_staged_lease_expires_on_an_idle_engine(client):
    """Staging lets the engine go idle at once, so only the endpoint's own clock can end the lease."""
    before = await wait_all_blocks_free(client)
    await hold_unpulled(client, "never-pulled-staged", prompt_of(STAGED_BLOCKS, 1000))
    held = await wait_staged(client, before.transfer.leases_staged + 1)
    assert held.transfer.active_leases == 1 and held.transfer.staged_bytes > 0, held.transfer

    await wait_lease_ended(client, before.transfer.leases_expired, timeout=LEASE_SECONDS + 5)
    await assert_back_to(client, before)


async def test_in_place_lease_holds_engine_blocks_until_it_expires(client):
    before = await wait_all_blocks_free(client)
    prompt = prompt_of(IN_PLACE_BLOCKS, 7000)
    await hold_unpulled(client, "never-pulled-in-place", prompt)
    held = await wait_granted(client)
    assert held.transfer.staged_bytes == 0 and held.transfer.leases_staged == before.transfer.leases_staged, \
        f"the long lease should not fit the staging budget: {held.transfer}"
    assert before.load.num_free_blocks - held.load.num_free_blocks >= IN_PLACE_BLOCKS, held.load

    await wait_lease_ended(client, before.transfer.leases_expired, timeout=LEASE_SECONDS + 5)
    await assert_back_to(client, before)


async def test_late_pull_of_an_expired_lease_is_refused_and_the_worker_stays_up(client, producer):
    before = await wait_all_blocks_free(client)
    prompt = prompt_of(STAGED_BLOCKS, 13000)
    source = await hold_unpulled(client, "pulled-too-late", prompt)
    await wait_lease_ended(client, before.transfer.leases_expired, timeout=LEASE_SECONDS + 5)

    context = zmq.Context.instance()
    layout = fetch_transfer_stats(context, producer.transfer_address).layout
    started = time.monotonic()
    with pytest.raises(PullFailed, match="expired"):
        pull_blocks(context, source, [0, 1], layout, lambda layer, data: None, deadline=started + 30)
    assert time.monotonic() - started < 1.0, "an expired handle should be refused at once, not parked"

    after = await assert_back_to(client, before)
    assert after.transfer.bytes_sent == before.transfer.bytes_sent
    # Still serving: the same prompt runs again and hits its own prefix cache.
    tokens = await collect(client.generate(wire.GenerateRequest(
        request_id="after-late-pull", prompt_token_ids=prompt, sampling=wire.SamplingSpec(max_tokens=4))))
    assert len(tokens) == 4
    assert producer.process.poll() is None


async def test_a_lease_is_servable_while_the_next_step_still_computes(client, producer):
    """A finishes in the step where B's prefill begins; the next step computes the rest of
    B (a whole step of tokens, seconds on CPU). A's lease must be granted before that
    forward pass, not after it: a consumer pulling right after A's first token would
    otherwise wait the whole step, or be refused once its parked pull gives up."""
    before = await wait_idle(client)
    first = [20000 + i % 5000 for i in range(STEP_TOKENS + 88)]  # step 1: a full step; step 2: the last 88
    second = [26000 + i % 5000 for i in range(2 * STEP_TOKENS - 88)]  # step 2: the rest of it; step 3: a full step
    sampling = wire.SamplingSpec(max_tokens=1, temperature=0.0)
    first_stream = client.generate(wire.GenerateRequest(
        request_id="granted-mid-step", prompt_token_ids=first, hold_blocks=True, sampling=sampling))
    first_chunks = asyncio.ensure_future(_chunks(first_stream))
    await asyncio.sleep(0.05)  # one connection, in order: the short request is queued first
    second_done = asyncio.ensure_future(_chunks(client.generate(wire.GenerateRequest(
        request_id="long-next-step", prompt_token_ids=second, sampling=sampling))))

    try:
        source = (await first_chunks)[-1].pull_source
        first_token_at = time.monotonic()
        assert source is not None, "the held request returned no pull source"
        context = zmq.Context.instance()
        layout = fetch_transfer_stats(context, producer.transfer_address).layout
        await asyncio.to_thread(pull_blocks, context, source, [0], layout, lambda layer, data: None,
                                time.monotonic() + 30)
        pulled_after = time.monotonic() - first_token_at
        assert release_lease(context, producer.transfer_address, source.handle, "test")
        assert not second_done.done(), "the long request finished before the pull; the step was too short to tell"
        await second_done
        next_step_took = time.monotonic() - first_token_at
    finally:
        second_done.cancel()
        await asyncio.gather(second_done, return_exceptions=True)
    assert pulled_after < 0.5 * next_step_took, (
        f"the pull waited {pulled_after:.2f} s of a {next_step_took:.2f} s step for its lease")

    after = await wait_idle(client)
    assert after.transfer.active_leases == 0 and after.transfer.leases_expired == before.transfer.leases_expired


async def _chunks(stream) -> list[wire.GenerateChunk]:
    return [chunk async for chunk in stream]
