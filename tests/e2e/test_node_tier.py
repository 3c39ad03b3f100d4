"""The node KV tier with a real engine (transfer.node_store): one unified worker with a small KV
cache writes every prompt it computes through to the node store of its host. A prompt evicted
from the engine's cache by others comes back from the store's host memory, or from its disk
tier after host memory demoted it, with output token-identical to the first run and its tier
tokens counted; another tenant's identical prompt finds nothing there; a killed store costs
only the recompute."""

from __future__ import annotations

import asyncio
import time

import pytest

from foundation import wire
from foundation.launcher import launch_node_store
from foundation.netutil import free_port, tcp
from orchestrator.disagg import HandoffRecord, generate_local
from orchestrator.worker_client import WorkerClient
from tests.cluster import START_TIMEOUT, collect, start_worker, wait_idle
from tests.e2e.disagg import chat_prompt
from transfer.node_store.client import NodeStoreClient

pytestmark = pytest.mark.timeout(300)

GREEDY_16 = wire.SamplingSpec(max_tokens=16, temperature=0.0)
BLOCK_SIZE = 32
# float32 SmolLM2: 1.47 MB a block of 32 tokens. The engine's cache holds 43 blocks; three
# fillers of ~22 blocks each push any earlier prompt out of it.
ENGINE = ["--kv-cache-gib", "0.06", "--max-model-len", "1024"]
FILLERS = ("the migration of birds", "how compilers work", "the water cycle")


class NodeStore:
    """The worker's node store, restarted on the same address with each test's budgets."""

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.address = tcp("127.0.0.1", free_port())
        self.process = None
        self.client = NodeStoreClient(self.address)

    def restart(self, host_gib: float, disk_gib: float = 0.0) -> NodeStoreClient:
        self.stop()
        args = ["--bind", self.address, "--host-kv-gib", str(host_gib), "--pin-seconds", "1"]
        if disk_gib:
            args += ["--disk-kv-dir", str(self.log_dir), "--disk-kv-gib", str(disk_gib)]
        self.process = launch_node_store(args, self.log_dir)
        self.process.wait_ready(30)
        return self.client

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None


@pytest.fixture(scope="module")
def node_store(tmp_path_factory):
    """Started before the worker, as a deployment does: the engine's first prompts find it."""
    store = NodeStore(tmp_path_factory.mktemp("store"))
    store.restart(host_gib=0.3)
    yield store
    store.stop()
    store.client.close()


@pytest.fixture(scope="module")
def worker(tmp_path_factory, node_store):
    launched = start_worker("unified", tmp_path_factory.mktemp("tier"), "0",
                            [*ENGINE, "--node-store", node_store.address])
    try:
        launched.wait_ready(START_TIMEOUT)
        yield launched
    finally:
        launched.stop()


@pytest.fixture
async def client(worker):
    client = WorkerClient(worker.rpc_address)
    yield client
    stats = await writes_done(client)
    assert stats.transfer.active_pulls == 0 and stats.num_active_requests == 0, stats
    await client.close()


async def writes_done(client: WorkerClient, timeout: float = 15.0) -> wire.WorkerStats:
    """The worker's stats once it is idle and every write-through it began has ended."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await wait_idle(client)
        transfer = stats.transfer
        if transfer.tier_saves_staged == transfer.tier_saves + transfer.tier_saves_failed:
            return stats
        assert time.monotonic() < deadline, f"write-throughs still running: {transfer}"
        await asyncio.sleep(0.1)


def prompt_about(tokenizer, topic: str, repeats: int = 40) -> list[int]:
    text = f"Question about {topic}. " + f"Please explain {topic} in detail. " * repeats
    return chat_prompt(tokenizer, [{"role": "user", "content": text}])


async def run(client: WorkerClient, request_id: str, prompt: list[int],
              salt: str) -> tuple[list[int], wire.GenerateChunk]:
    chunks = [chunk async for chunk in client.generate(wire.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=GREEDY_16, cache_salt=salt))]
    return [token for chunk in chunks for token in chunk.token_ids], chunks[-1]


async def fill_engine_cache(client: WorkerClient, tokenizer, tag: str) -> None:
    """Three other prompts, so the engine's small cache evicts everything before them."""
    for topic in FILLERS:
        await run(client, f"{tag}-filler-{topic}", prompt_about(tokenizer, f"{topic} ({tag})", 70), "fillers")


async def stored_blocks(store: NodeStoreClient, at_least: int, timeout: float = 20.0) -> wire.TierCounters:
    """The store's counters once it holds ``at_least`` blocks (written through asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        counters = (await asyncio.to_thread(store.stats)).counters
        if counters.host_blocks + counters.disk_blocks >= at_least:
            return counters
        assert time.monotonic() < deadline, f"the store never held {at_least} blocks: {counters}"
        await asyncio.sleep(0.1)


def full_blocks(prompt: list[int]) -> int:
    """The prompt's blocks a load can bring: full ones, leaving the last token to compute."""
    return (len(prompt) - 1) // BLOCK_SIZE


async def test_an_evicted_prefix_loads_back_from_host_memory_and_not_for_another_tenant(client, tokenizer,
                                                                                          node_store):
    store = node_store.restart(host_gib=0.3)
    prompt = prompt_about(tokenizer, "the rules of chess")
    first, last = await run(client, "host-1", prompt, "tenant-a")
    assert last.num_tier_tokens == 0
    await stored_blocks(store, full_blocks(prompt))
    await fill_engine_cache(client, tokenizer, "host")
    # The store serves one message at a time: a lookup queued behind the fillers' write-throughs
    # on a loaded machine misses its 0.5 s and is computed instead, which this test is not about.
    await writes_done(client)
    # As the orchestrator runs a LOCAL plan: what it records becomes the response's usage.
    record = HandoffRecord(request_id="host-2")
    await collect(generate_local(client, record, prompt, GREEDY_16, "tenant-a"))
    assert record.token_ids == first, "the prompt loaded from the tier must give the same greedy output"
    assert record.prefill_tier_tokens == full_blocks(prompt) * BLOCK_SIZE
    assert record.prefill_cached_tokens == record.prefill_tier_tokens, "the engine's own cache had evicted it"
    assert 0 < record.prefill_tier_seconds < 5, "the load's time, from the lookup on, is reported"
    counters = (await asyncio.to_thread(store.stats)).counters
    assert counters.blocks_served == full_blocks(prompt) and counters.promotions == 0
    stats = await wait_idle(client)
    assert stats.transfer.tier_loads_ok >= 1 and stats.transfer.tier_blocks_loaded >= full_blocks(prompt)

    _, other = await run(client, "host-b", prompt, "tenant-b")
    assert other.num_tier_tokens == 0 and other.num_cached_tokens == 0, "tenant B must not reuse A's blocks"


async def test_a_disk_round_trip(client, tokenizer, node_store):
    store = node_store.restart(host_gib=0.03, disk_gib=0.5)  # host memory: 21 blocks
    prompt = prompt_about(tokenizer, "how bread is baked")
    first, _ = await run(client, "disk-1", prompt, "tenant-a")
    await stored_blocks(store, full_blocks(prompt))
    await fill_engine_cache(client, tokenizer, "disk")
    counters = await stored_blocks(store, full_blocks(prompt) + 60)
    assert counters.demotions >= full_blocks(prompt), counters
    again, last = await run(client, "disk-2", prompt, "tenant-a")
    assert again == first
    assert last.num_tier_tokens == full_blocks(prompt) * BLOCK_SIZE and last.tier_seconds > 0
    counters = (await asyncio.to_thread(store.stats)).counters
    assert counters.promotions >= full_blocks(prompt) and counters.corrupt_blocks == 0, counters


async def test_a_killed_store_costs_only_the_recompute(client, tokenizer, node_store):
    store = node_store.restart(host_gib=0.3)
    prompt = prompt_about(tokenizer, "the life cycle of stars")
    first, _ = await run(client, "dead-1", prompt, "tenant-a")
    await stored_blocks(store, full_blocks(prompt))
    node_store.process.kill()
    await fill_engine_cache(client, tokenizer, "dead")
    started = time.monotonic()
    again, last = await run(client, "dead-2", prompt, "tenant-a")
    assert again == first and last.num_tier_tokens == 0 and last.num_cached_tokens == 0
    assert time.monotonic() - started < 5, "a dead store must not hold a request for long"
