"""``kvroute serve``: the embedded default — orchestrator plus worker pools on this machine.

::

    prepare model ─▶ start HTTP API + registry ─▶ launch N prefill + M decode workers
        ─▶ wait until every worker registered ─▶ print the URL ─▶ serve until Ctrl-C/SIGTERM
        ─▶ stop the API, then SIGTERM every worker (SIGKILL stragglers): no orphans
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import uvicorn
import uvloop

from foundation.config import setting
from foundation.launcher import LaunchedWorker, WorkerStartError, error_lines, launch_worker, stop_all
from foundation.model_prep import resolve_model
from foundation.netutil import free_port
from orchestrator.app import create_app
from orchestrator.settings import OrchestratorSettings
from transfer.link_names import ENDPOINT, check_transfer_link
from worker.settings import WorkerSettings

logger = logging.getLogger("kvroute.serve")


@dataclass(frozen=True)
class PoolSettings:
    prefill_workers: int = setting(1, "prefill workers to start")
    decode_workers: int = setting(1, "decode workers to start")
    # 0.5 GiB holds 8192 tokens of SmolLM2 in float32 (46,080 bytes a token), the default max_model_len.
    kv_cache_gib: float = setting(0.5, "each worker's KV cache in GiB, fractions allowed")
    dtype: str = setting("auto", "engine dtype of the workers; auto: bfloat16 where the hardware has "
                                 "bf16 instructions (GPUs, AVX512-BF16/AMX CPUs), else float32")
    worker_start_timeout: float = setting(600.0, "seconds to wait for the workers to register")
    log_dir: str = setting("", "folder for the workers' logs; default: a new temporary folder")
    transfer_link: str = setting(ENDPOINT, "how pulled KV travels: endpoint (back on the pull's own "
                                           "connection) or a transport link per worker pair: auto, "
                                           "zmq-tcp, zmq-ipc, gloo, nccl")
    shared_copies: bool = setting(True, "decode workers read a prefill worker's staged KV from shared memory "
                                        "(all workers run on this host); off: every pull as frames, as between "
                                        "hosts")
    evict_pulled_first: bool = setting(True, "decode workers evict the prompts they pulled before the ones they "
                                             "prefilled themselves (the prefill worker most likely still holds "
                                             "them); off: vLLM's plain LRU order")
    pull_timeout_seconds: float = setting(WorkerSettings.pull_timeout_seconds,
                                          "seconds a decode worker waits for a pull of KV before it recomputes "
                                          "the prompt itself")

    def __post_init__(self):
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ValueError("need at least one prefill and one decode worker")
        check_transfer_link(self.transfer_link)


def worker_args(pool: PoolSettings, orchestrator: OrchestratorSettings, model: str, core: int) -> list[str]:
    return ["--model", model, "--dtype", pool.dtype, "--kv-cache-gib", str(pool.kv_cache_gib),
            "--max-model-len", str(orchestrator.max_model_len), "--transfer-link", pool.transfer_link,
            "--orchestrator", f"tcp://127.0.0.1:{orchestrator.registry_port}",
            # Engines sharing a machine get a core each, not all of them each.
            "--omp-threads-bind", str(core), "--pull-timeout-seconds", str(pool.pull_timeout_seconds),
            *([] if pool.shared_copies else ["--no-shared-copies"]),
            *([] if pool.evict_pulled_first else ["--no-evict-pulled-first"])]


def launch_pool(pool: PoolSettings, orchestrator: OrchestratorSettings, model: str) -> list[LaunchedWorker]:
    log_dir = Path(pool.log_dir or tempfile.mkdtemp(prefix="kvroute-serve-"))
    roles = ["prefill"] * pool.prefill_workers + ["decode"] * pool.decode_workers
    cores = os.cpu_count() or 1
    workers = [launch_worker(role, worker_args(pool, orchestrator, model, i % cores), log_dir)
               for i, role in enumerate(roles)]
    logger.info("launched %d workers; logs in %s", len(workers), log_dir)
    return workers


async def wait_registered(app, workers: list[LaunchedWorker], timeout: float) -> None:
    fleet = app.state.fleet
    expected = {"prefill": sum(w.role == "prefill" for w in workers),
                "decode": sum(w.role == "decode" for w in workers)}
    deadline = asyncio.get_running_loop().time() + timeout
    while any(len(fleet.live(role)) < count for role, count in expected.items()):
        for worker in workers:
            if worker.process.poll() is not None:
                raise WorkerStartError(f"a {worker.role} worker exited; see {worker.log_path}:\n"
                                       f"{error_lines(worker.log_path)}")
        if asyncio.get_running_loop().time() > deadline:
            raise WorkerStartError(f"workers did not register within {timeout:.0f} s")
        await asyncio.sleep(0.5)


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured Ctrl-C after shutting down, which would interrupt the
    workers' shutdown; ``serve`` handles SIGINT and SIGTERM itself instead."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _stop_on_signals(server: uvicorn.Server) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))


async def serve(orchestrator: OrchestratorSettings, pool: PoolSettings) -> None:
    model = resolve_model(orchestrator.model, progress=True)
    orchestrator = replace(orchestrator, model=model, registry_port=free_port())
    app = create_app(orchestrator)
    server = _Server(uvicorn.Config(app, **orchestrator.http_server_options(), timeout_graceful_shutdown=5))
    _stop_on_signals(server)
    api = asyncio.create_task(server.serve())
    workers: list[LaunchedWorker] = []
    try:
        while not server.started and not api.done():
            await asyncio.sleep(0.1)
        if api.done():
            return
        workers = launch_pool(pool, orchestrator, model)
        if not await _race(api, wait_registered(app, workers, pool.worker_start_timeout)):
            return  # stopped (Ctrl-C) while the workers were starting
        print(f"kvroute is serving at http://{orchestrator.host}:{orchestrator.port}/v1 "
              f"(model '{app.state.model_name}'); Ctrl-C stops it", flush=True)
        await api
    finally:
        server.should_exit = True
        await asyncio.gather(api, return_exceptions=True)
        await asyncio.to_thread(stop_all, workers)
        logger.info("stopped %d workers", len(workers))


async def _race(api: asyncio.Task, waiting) -> bool:
    """Wait for ``waiting``; False if the API server stopped first (e.g. Ctrl-C during start-up)."""
    waiter = asyncio.ensure_future(waiting)
    done, _ = await asyncio.wait([api, waiter], return_when=asyncio.FIRST_COMPLETED)
    if waiter not in done:
        waiter.cancel()
        return False
    waiter.result()
    return True


def run_serve(orchestrator: OrchestratorSettings, pool: PoolSettings) -> int:
    logging.basicConfig(level=orchestrator.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # uvicorn's loop="uvloop" only applies when uvicorn owns the loop; here serve() does.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(orchestrator, pool))
    except WorkerStartError as error:
        logger.error("%s", error)
        return 1
    return 0
