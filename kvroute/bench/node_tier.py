"""What the node KV tier costs and saves: the write-through's copy on the engine's thread, a
put, a load back from the store's host memory and from its disk tier, per prompt length; and,
with ``--engine``, a real engine's first token for a cold prompt (recompute), the same prompt
hit in its own cache, and hit in the node store after the engine's cache was emptied.

Store paths: a real ``kvroute node-store`` process and a paged cache in SmolLM2-135M's layout
(30 layers, 3 KV heads of 64, blocks of 32 tokens, ``--dtype``) in this process, which stages
and reads blocks as a connector does (``transfer.node_store.cache_io``). Per length and
repetition, fresh blocks A are staged and put, loaded back from host memory, then blocks B
put into a store whose host memory holds one prompt (so A goes to disk) and A loaded again
(from disk, checked, through host memory). Medians of ``--reps``.

Engine: one unified worker (``--omp-threads-bind 0``) with a node store; per length a fresh
prompt cold, again (the engine's own cache), and again after ``reset-cache`` (the store's
host memory). The write-through's staging time comes from the worker's counters. Results
go to ``--output``/results.json; a table is printed.

Usage::

    kvroute bench node-tier [--output DIR] [--reps N] [--lengths 256,1024,4096] [--dtype float32]
                            [--engine] [--engine-lengths 512,2048]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from foundation import wire
from foundation.launcher import LaunchedWorker, launch_node_store, launch_worker
from foundation.netutil import free_port, tcp
from kvroute.bench.command import Command
from kvroute.bench.run_keys import speaking_to_workers

BLOCK_SIZE, NUM_LAYERS, KV_HEADS, HEAD_SIZE = 32, 30, 3, 64  # SmolLM2-135M
GIB = 1 << 30
PIN_SECONDS = 0.01  # a get keeps its blocks from eviction this long


def _cache(num_blocks: int, dtype: str):
    import torch

    from transfer.kv_layout import PagedKVCache

    kind = getattr(torch, dtype)
    # vLLM-CPU's layout: per layer (blocks, KV heads, block size, keys then values of one head).
    layers = [torch.randn(num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE).to(kind) for _ in range(NUM_LAYERS)]
    return PagedKVCache(layers, num_blocks, BLOCK_SIZE)


def _store(log_dir: Path, host_blocks: int, disk_blocks: int, block_bytes: int) -> tuple[LaunchedWorker, str]:
    address = tcp("127.0.0.1", free_port())
    gib = lambda blocks: str((blocks * block_bytes + 1) / GIB)  # noqa: E731
    disk = ["--disk-kv-dir", str(log_dir), "--disk-kv-gib", gib(disk_blocks)] if disk_blocks else []
    store = launch_node_store(["--bind", address, "--host-kv-gib", gib(host_blocks), *disk,
                               "--pin-seconds", str(PIN_SECONDS)], log_dir)
    store.wait_ready(30)
    return store, address


def _seconds(action) -> tuple[float, object]:
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def measure_store_paths(num_blocks: int, reps: int, dtype: str, log_dir: Path) -> dict[str, float]:
    """Median seconds of each path for a prompt of ``num_blocks`` blocks."""
    from transfer.memfd import local_host
    from transfer.node_store.cache_io import StagingPool, read_blocks
    from transfer.node_store.client import NodeStoreClient

    cache = _cache(2 * num_blocks + 1, dtype)
    store, address = _store(log_dir, host_blocks=num_blocks, disk_blocks=4 * num_blocks,
                            block_bytes=cache.spec.bytes_per_block)
    client = NodeStoreClient(address)
    ids = list(range(num_blocks))
    times: dict[str, list[float]] = {}
    staging = StagingPool()  # as a connector stages, reusing its copies

    def put(keys: list[bytes]) -> None:
        stage, copy = _seconds(lambda: staging.stage(cache, ids))
        times.setdefault("stage", []).append(stage)
        data = memoryview(copy.mapping)[:num_blocks * cache.spec.bytes_per_block]
        times.setdefault("put", []).append(_seconds(lambda: client.put(keys, cache.spec, copy.ref(num_blocks),
                                                                        data))[0])
        data.release()
        staging.give_back(copy)

    def load(keys: list[bytes], tier: str) -> None:
        seconds, _ = _seconds(lambda: read_blocks(*client.get(keys, cache.spec, local_host()), cache, ids))
        times.setdefault(f"load from {tier}", []).append(seconds)
        time.sleep(2 * PIN_SECONDS)  # the blocks' pins end, so the next put may evict them

    try:
        for _ in range(reps + 1):  # the first is a warm-up
            first, second = ([random.randbytes(16) for _ in ids] for _ in range(2))
            put(first)
            load(first, "host memory")
            put(second)  # host memory holds one prompt: the first goes to disk
            load(first, "disk")
        return {path: statistics.median(values[2:] if path in ("stage", "put") else values[1:])
                for path, values in times.items()}
    finally:
        staging.close()
        client.close()
        store.stop()


async def _first_token(client, prompt: list[int], salt: str) -> tuple[float, wire.GenerateChunk]:
    request = wire.GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, cache_salt=salt,
                                   sampling=wire.SamplingSpec(max_tokens=1, ignore_eos=True))
    started, seconds, last = time.perf_counter(), None, None
    async for chunk in client.generate(request, timeout=300):
        if chunk.token_ids and seconds is None:
            seconds = time.perf_counter() - started
        last = chunk
    return seconds, last


async def measure_engine(lengths: list[int], reps: int, dtype: str, log_dir: Path) -> dict[int, dict[str, float]]:
    from foundation.model_prep import resolve_model
    from orchestrator.worker_client import WorkerClient

    store, address = _store(log_dir, host_blocks=4096, disk_blocks=0, block_bytes=BLOCK_SIZE * 46080)
    worker = launch_worker("unified", ["--model", resolve_model(None), "--dtype", dtype, "--kv-cache-gib", "1",
                                       "--max-model-len", "8192", "--omp-threads-bind", "0", "--node-store", address],
                           log_dir)
    results: dict[int, dict[str, float]] = {}
    try:
        worker.wait_ready(900)
        client = WorkerClient(worker.rpc_address)
        rng = random.Random(0)
        for length in lengths:
            runs: dict[str, list[float]] = {}
            for _ in range(reps):
                prompt, salt = [rng.randrange(1000, 40000) for _ in range(length)], uuid.uuid4().hex
                before = (await client.stats()).transfer
                runs.setdefault("recompute (cold)", []).append((await _first_token(client, prompt, salt))[0])
                runs.setdefault("engine cache hit", []).append((await _first_token(client, prompt, salt))[0])
                await asyncio.sleep(0.5)  # the write-through has run by then
                after = (await client.stats()).transfer
                runs.setdefault("write-through staging", []).append(
                    (after.tier_stage_microseconds - before.tier_stage_microseconds) / 1e6)
                await client.reset_cache()
                seconds, last = await _first_token(client, prompt, salt)
                assert last.num_tier_tokens > 0, "the prompt did not come back from the node store"
                runs.setdefault("node store hit (host memory)", []).append(seconds)
            results[length] = {name: statistics.median(values) for name, values in runs.items()}
        await client.close()
        return results
    finally:
        worker.stop()
        store.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="results/bench_node_tier")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--lengths", default="256,1024,4096", help="prompt lengths in tokens (store paths)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--engine", action="store_true", help="also measure a real engine (minutes)")
    parser.add_argument("--engine-lengths", default="512,2048")
    parser.add_argument("--engine-reps", type=int, default=3)


def run(args: argparse.Namespace) -> int:
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    with speaking_to_workers():  # the store and worker processes, and the worker RPC
        report: dict = {"dtype": args.dtype, "reps": args.reps, "store": {}}
        with tempfile.TemporaryDirectory(prefix="kvroute-node-tier-") as scratch:
            for tokens in (int(n) for n in args.lengths.split(",")):
                paths = measure_store_paths(tokens // BLOCK_SIZE, args.reps, args.dtype, Path(scratch))
                report["store"][tokens] = paths
                print(f"{tokens:>6} tokens: " + ", ".join(f"{name} {seconds * 1e3:.2f} ms"
                                                          for name, seconds in paths.items()), flush=True)
            if args.engine:
                lengths = [int(n) for n in args.engine_lengths.split(",")]
                report["engine"] = asyncio.run(measure_engine(lengths, args.engine_reps, args.dtype, Path(scratch)))
                for tokens, paths in report["engine"].items():
                    print(f"engine, {tokens:>6} tokens: " + ", ".join(f"{name} {seconds * 1e3:.1f} ms"
                                                                      for name, seconds in paths.items()), flush=True)
    (output / "results.json").write_text(json.dumps(report, indent=2))
    return 0


COMMAND = Command("node-tier", "the node KV tier: write-through cost, loads from host memory and disk, "
                               "against recompute", __doc__, add_arguments, run)
parse_args, main = COMMAND.parse_args, COMMAND.main
