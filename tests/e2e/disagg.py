"""Prompts and checks of the disaggregated path on real engines, shared by the tests that
run it over the transfer endpoint (test_disagg), over a link (test_links) and between unified
replicas (test_unified)."""

from __future__ import annotations

import math
import time

from foundation import wire
from orchestrator.worker_client import WorkerClient
from tests.cluster import START_TIMEOUT, Clients, start_worker, wait_idle

GREEDY_32 = wire.SamplingSpec(max_tokens=32, temperature=0.0)
TOPICS = ["the history of Paris", "how bread is baked", "the life cycle of stars", "how bees make honey",
          "the rules of chess", "the water cycle", "how compilers work", "the migration of birds"]
# Approximate prompt lengths in tokens: below one block (128) up to more than six blocks.
REPEATS = [1, 6, 10, 14, 25, 40, 60, 85]


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def question(index: int) -> list[dict]:
    topic = TOPICS[index]
    filler = f"Please explain {topic} in detail. " * REPEATS[index]
    return [{"role": "user", "content": f"Question {index} about {topic}. {filler}"}]


async def transfer_delta(clients: Clients, run):
    before = (await clients.prefill.stats(), await clients.decode.stats())
    result = await run()
    after = (await wait_idle(clients.prefill), await wait_idle(clients.decode))
    return result, before, after


def assert_loaded_not_recomputed(record, before, after, shared: bool = True) -> None:
    producer_before, consumer_before = before
    producer_after, consumer_after = after
    bytes_per_block = consumer_after.load.bytes_per_block
    block_size = consumer_after.load.block_size
    local_hit = consumer_after.prompt_tokens.local_cache_hit - consumer_before.prompt_tokens.local_cache_hit
    blocks_moved = consumer_after.transfer.blocks_received - consumer_before.transfer.blocks_received
    bytes_moved = consumer_after.transfer.bytes_received - consumer_before.transfer.bytes_received
    external = (consumer_after.prompt_tokens.external_kv_transfer
                - consumer_before.prompt_tokens.external_kv_transfer)
    prompt_tokens = record.pull_source.num_tokens
    assert blocks_moved == math.ceil(prompt_tokens / block_size) - local_hit // block_size
    assert bytes_moved == blocks_moved * bytes_per_block
    # The decode worker reports this request's own pull, as its connector timed it.
    assert record.transfer is not None and record.transfer.ok
    assert record.transfer.num_bytes == bytes_moved and record.transfer.seconds > 0
    # When it began, in wall-clock seconds: where the decode worker's kvroute.kv_pull span starts.
    assert time.time() - 600 < record.transfer.started_at <= time.time() - record.transfer.seconds
    assert producer_after.transfer.bytes_sent - producer_before.transfer.bytes_sent == bytes_moved
    # Both workers run on this host, so the blocks came from the producer's shared copy
    # (transfer.shared_copies) unless the consumer was started with --no-shared-copies.
    shared_pulls = consumer_after.transfer.shared_pulls - consumer_before.transfer.shared_pulls
    assert shared_pulls == (int(blocks_moved > 0) if shared else 0)
    # vLLM's own accounting: every prompt token not found locally came from the transfer.
    assert external == prompt_tokens - local_hit
    assert producer_after.transfer.leases_released > producer_before.transfer.leases_released


async def lend_then_die(role: str, log_dir, prompt: list[int], request_id: str,
                        extra: tuple[str, ...] = ()) -> wire.GenerateChunk:
    """A fresh worker of ``role`` (with flags ``extra``) prefills ``prompt`` under a lease and
    is killed before anyone pulls: the first chunk, whose ``pull_source`` now points at nothing."""
    doomed = start_worker(role, log_dir, "0", list(extra))
    doomed.wait_ready(START_TIMEOUT)
    doomed_client = WorkerClient(doomed.rpc_address)
    try:
        head = [c async for c in doomed_client.generate(wire.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, hold_blocks=True,
            sampling=wire.SamplingSpec(max_tokens=1)))][-1]
        assert head.pull_source is not None
        return head
    finally:
        await doomed_client.close()
        doomed.kill()


async def assert_a_killed_producer_costs_only_a_recompute(puller: WorkerClient, role: str, log_dir,
                                                         prompt: list[int], name: str,
                                                         extra: tuple[str, ...] = ()) -> str:
    """A producer of ``role`` lends ``prompt``'s KV and dies; ``puller``'s pull of it fails
    (counted, nothing received) and the engine recomputes: the 32 tokens match ``puller``'s own
    (or part at a near-tie). Returns the verdict."""
    head = await lend_then_die(role, log_dir, prompt, name, extra)
    reference = [c async for c in puller.generate(wire.GenerateRequest(
        request_id=f"{name}-ref", prompt_token_ids=prompt, cache_salt=f"reference-{name}",
        sampling=wire.SamplingSpec(max_tokens=32, logprobs=2)))]
    before = await puller.stats()
    rest = [c async for c in puller.generate(wire.GenerateRequest(
        request_id=f"{name}-decode", prompt_token_ids=prompt + head.token_ids,
        sampling=wire.SamplingSpec(max_tokens=31), pull_from=head.pull_source))]
    after = await wait_idle(puller)
    assert after.transfer.pulls_failed == before.transfer.pulls_failed + 1
    assert after.transfer.bytes_received == before.transfer.bytes_received
    assert after.transfer.direct_pulls == before.transfer.direct_pulls
    output = head.token_ids + [t for chunk in rest for t in chunk.token_ids]
    verdict = compare_with_reference(output, reference)
    assert len(output) == 32 and (verdict == "identical" or verdict.startswith("diverged at a near-tie")), verdict
    return verdict


def compare_with_reference(output: list[int], reference: list[wire.GenerateChunk]) -> str:
    """'identical', or where the output first differs and the reference's top-2 gap there."""
    tokens = [t for chunk in reference for t in chunk.token_ids]
    logprobs = [lp for chunk in reference for lp in (chunk.logprobs or [])]
    for position, (ours, theirs) in enumerate(zip(output, tokens)):
        if ours != theirs:
            ranked = logprobs[position].logprobs
            gap = ranked[0] - ranked[1]
            kind = "diverged at a near-tie" if gap < 0.05 else "diverged"
            return f"{kind}: position {position}, top-2 gap {gap:.4f}"
    return "identical"
