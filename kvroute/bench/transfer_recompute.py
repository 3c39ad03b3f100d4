"""Recompute time on the real engine: one kvroute worker (a vLLM engine) prefilling prompts.

The worker is started as every kvroute benchmark starts one (``foundation.launcher``) and
stopped at the end, also on errors. Recompute seconds of a prompt are its time to first
token with ``max_tokens=1``: the prefill a decode worker would run instead of pulling
the prompt's KV. Every request carries a fresh cache salt and fresh random token ids,
so no prefix-cache block is ever reused; prefill cost does not depend on which tokens
they are. The engine also reports its KV layout, which sizes the transfers.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import zmq

from foundation import wire
from foundation.endpoint_client import fetch_transfer_stats
from foundation.launcher import LaunchedWorker, launch_worker
from kvroute.bench.transfer_sweep import KVBytes, kv_bytes_from_config
from orchestrator.worker_client import WorkerClient

REQUEST_TIMEOUT = 600.0
_FIRST_TOKEN_ID = 1000  # above the special and byte tokens, which are all a vocabulary's first ids


def kv_bytes_from_engine(layout: wire.KVLayoutSpec) -> KVBytes:
    return KVBytes(layout.bytes_per_block // layout.block_size, layout.num_layers, layout.dtype, source="engine")


def kv_bytes_from_model(model: str, dtype: str) -> KVBytes:
    """Without an engine: from the model's config.json and the dtype a worker would pick."""
    import torch

    config = json.loads((Path(model) / "config.json").read_text())
    return kv_bytes_from_config(config, getattr(torch, dtype).itemsize, dtype)


class RecomputeEngine:
    """One worker; ``seconds(tokens)`` is one cold prefill of a fresh prompt of that length."""

    def __init__(self, model: str, dtype: str, max_prompt_tokens: int, log_dir: Path, start_timeout: float):
        model_config = json.loads((Path(model) / "config.json").read_text())
        self.vocab_size = model_config["vocab_size"]
        # Room for the one output token, within the model's positions: a prompt as long as
        # the model's context runs one token short (8191 of 8192), which no timing can tell.
        self.max_model_len = min(max_prompt_tokens + 1, model_config.get("max_position_embeddings", 1 << 30))
        self.rng = random.Random(1234)
        args = ["--model", model, "--dtype", dtype, "--kv-cache-gib", "1.0", "--max-model-len", str(self.max_model_len)]
        self.worker: LaunchedWorker = launch_worker("decode", args, log_dir)
        self.start_timeout = start_timeout

    def __enter__(self) -> RecomputeEngine:
        try:
            self.worker.wait_ready(self.start_timeout)
        except BaseException:
            self.worker.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.worker.stop()

    def kv_bytes(self) -> KVBytes:
        stats = fetch_transfer_stats(zmq.Context.instance(), self.worker.transfer_address, timeout=30.0)
        return kv_bytes_from_engine(stats.layout)

    def prompt_tokens_run(self, tokens: int) -> int:
        """The prompt length actually prefilled for a sweep length of ``tokens``."""
        return min(tokens, self.max_model_len - 1)

    def _prompt(self, tokens: int) -> list[int]:
        return [self.rng.randrange(_FIRST_TOKEN_ID, self.vocab_size) for _ in range(self.prompt_tokens_run(tokens))]

    async def _seconds(self, client: WorkerClient, tokens: int) -> float:
        request = wire.GenerateRequest(request_id=f"recompute-{uuid.uuid4().hex}",
                                       prompt_token_ids=self._prompt(tokens), cache_salt=uuid.uuid4().hex,
                                       sampling=wire.SamplingSpec(max_tokens=1, ignore_eos=True))
        seconds, cached = None, 0
        start = time.perf_counter()
        async for chunk in client.generate(request, REQUEST_TIMEOUT):
            if seconds is None and chunk.token_ids:
                seconds = time.perf_counter() - start
            cached = max(cached, chunk.num_cached_tokens)
        if seconds is None or cached:
            raise RuntimeError(f"a fresh {tokens}-token prompt gave no token or hit {cached} cached tokens")
        return seconds

    async def _measure(self, lengths: list[int], reps: int, on_length: Callable[[int, dict], None]) -> dict:
        client = WorkerClient(self.worker.rpc_address)
        try:
            await self._seconds(client, lengths[0])  # warm-up: first requests pay one-off costs
            measured = {}
            for tokens in lengths:
                samples = [await self._seconds(client, tokens) for _ in range(reps)]
                measured[tokens] = {"samples": samples, "median": statistics.median(samples),
                                    "prompt_tokens_run": self.prompt_tokens_run(tokens)}
                on_length(tokens, measured[tokens])
            return measured
        finally:
            await client.close()

    def measure(self, lengths: list[int], reps: int,
                on_length: Callable[[int, dict], None] = lambda tokens, result: None) -> dict[int, dict]:
        """Per prompt length: the recompute seconds of each repetition and their median."""
        return asyncio.run(self._measure(lengths, reps, on_length))
