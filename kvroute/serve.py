"""``kvroute serve``: the embedded default — orchestrator plus worker pools on this machine.

::

    prepare model ─▶ start HTTP API + registry ─▶ pick the topology (``kvroute.topology``)
        ─▶ launch its node KV store (with --host-kv-gib), then its workers ─▶ wait until every worker registered
        ─▶ print the URL ─▶ serve until Ctrl-C/SIGTERM
        ─▶ stop the API, then SIGTERM every worker (SIGKILL stragglers), then the store: no orphans
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import uvloop

from foundation import cluster_keys, tracing
from foundation.config import setting
from foundation.launcher import (
    NODE_STORE,
    LaunchedWorker,
    WorkerStartError,
    error_lines,
    launch_node_store,
    launch_worker,
    stop_all,
)
from foundation.log_setup import LOG_FORMAT
from foundation.model_prep import resolve_model
from foundation.netutil import free_port, tcp
from foundation.wire import ROLES
from kvroute.topology import (
    AUTO,
    DEFAULT_CORES_PER_ENGINE,
    Engine,
    Topology,
    gpu_count,
    parse_spec,
    plan_topology,
    usable_cores,
)
from orchestrator.app import create_apps
from orchestrator.http_server import listeners, serve_all, stop_on_signals
from orchestrator.settings import OrchestratorSettings
from transfer.link_names import DEFAULT_TRANSFER_CHECKSUM, ENDPOINT, check_transfer_link, transfer_checksum_on
from transfer.node_store.settings import NodeStoreSettings
from worker.prompt_priority import check_scheduling
from worker.settings import WorkerSettings, check_decode_guard

logger = logging.getLogger("kvroute.serve")
NODE_STORE_START_SECONDS = 30.0  # torch-free: it serves within a second or two


@dataclass(frozen=True)
class PoolSettings:
    topology: str = setting(AUTO, "the workers to start: auto (picked from the machine; docs/topology.md), or "
                                  "counts and roles such as 1u, 2u, 2p1d, 1p1d1u (p: prefill, d: decode, "
                                  "u: unified, one engine that does both)")
    cores_per_engine: int = setting(DEFAULT_CORES_PER_ENGINE, "auto on CPUs: one engine per this many cores")
    # 0.5 GiB holds 8192 tokens of SmolLM2 in float32 (46,080 bytes a token), the default max_model_len.
    kv_cache_gib: float = setting(0.5, "each worker's KV cache in GiB, fractions allowed")
    total_kv_gib: float = setting(0.0, "the KV cache of all workers together in GiB, split evenly between "
                                       "them; 0: --kv-cache-gib each")
    dtype: str = setting("auto", "engine dtype of the workers; auto: bfloat16 where the hardware has "
                                 "bf16 instructions (GPUs, AVX512-BF16/AMX CPUs), else float32")
    worker_start_timeout: float = setting(600.0, "seconds to wait for the workers to register")
    log_dir: str = setting("", "folder for the workers' logs; default: a new temporary folder")
    transfer_link: str = setting(ENDPOINT, "how pulled KV travels: endpoint (back on the pull's own "
                                           "connection) or a transport link per worker pair: auto, "
                                           "zmq-tcp, zmq-ipc, gloo, nccl, nixl")
    shared_copies: bool = setting(True, "decode workers read a prefill worker's staged KV from shared memory "
                                        "(all workers run on this host); off: every pull as frames, as between "
                                        "hosts")
    evict_pulled_first: bool = setting(True, "decode workers evict the prompts they pulled before the ones they "
                                             "prefilled themselves (the prefill worker most likely still holds "
                                             "them); off: vLLM's plain LRU order")
    transfer_checksum: str = setting(DEFAULT_TRANSFER_CHECKSUM, "on: decode workers check an xxh3 checksum of "
                                                                "every pulled frame before storing it, and "
                                                                "recompute on a mismatch; off: no checksums")
    pull_timeout_seconds: float = setting(WorkerSettings.pull_timeout_seconds,
                                          "seconds a decode worker waits for a pull of KV before it recomputes "
                                          "the prompt itself")
    host_kv_gib: float = setting(0.0, "a node KV store for the workers: this much host memory in GiB keeps KV "
                                      "blocks evicted from every engine cache, for any engine to load back; 0: "
                                      "none (docs/transfer.md, \"Node KV tier\")")
    disk_kv_dir: str = setting("", "the node store's disk tier: a folder (its own subfolder, emptied at start and "
                                   "stop); blocks evicted from its host memory go there")
    disk_kv_gib: float = setting(0.0, "bytes of the node store's disk tier in GiB")
    long_prefill_tokens: int = setting(-1, "most tokens of one prompt in an engine step while other requests "
                                           "run or wait, given to every worker; -1: the role's default (256 on "
                                           "prefill and decode workers, none on unified ones), 0: no cap")
    step_tokens: int = setting(0, "most prompt tokens one engine step computes over all requests, given to every "
                                  "worker; smaller steps bound how long running streams wait for their next "
                                  "token; 0: vLLM's default (2048)")
    decoding_step_tokens: int = setting(0, "a fixed cap instead of requests' TPOT targets: most prompt tokens one "
                                           "engine step computes while any request decodes, given to every "
                                           "worker (worker.decode_guard); 0: none")
    decoding_tpot_target: float = setting(0.0, "seconds a token for decoding requests without a TPOT target of "
                                               "their own (the orchestrator gives each one; see "
                                               "tpot_target_seconds), given to every worker "
                                               "(worker.decode_guard); 0: none")
    scheduling: str = setting(WorkerSettings.scheduling, "which waiting prompt each engine computes first: fcfs "
                                                          "(vLLM's arrival order) or shortest-first (the shortest "
                                                          "expected prefill; docs/placement.md)")

    def __post_init__(self):
        if self.topology.strip().lower() != AUTO:
            parse_spec(self.topology)  # a bad spec fails here, before anything starts
        if self.cores_per_engine < 1:
            raise ValueError("cores_per_engine must be at least 1")
        if self.long_prefill_tokens < -1:
            raise ValueError("long_prefill_tokens must be -1 (the role's default), 0 (no cap) or positive")
        if self.step_tokens < 0:
            raise ValueError("step_tokens must be 0 (vLLM's default) or positive")
        check_decode_guard(self.decoding_step_tokens, self.decoding_tpot_target)
        check_scheduling(self.scheduling)
        if self.kv_cache_gib <= 0 or self.total_kv_gib < 0:
            raise ValueError("KV cache sizes must be positive")
        check_transfer_link(self.transfer_link)
        transfer_checksum_on(self.transfer_checksum)
        if self.host_kv_gib < 0:
            raise ValueError("host_kv_gib must not be negative")
        if (self.disk_kv_dir or self.disk_kv_gib) and self.host_kv_gib <= 0:
            raise ValueError("a disk tier needs a node store: give --host-kv-gib too")

    def node_store_settings(self) -> NodeStoreSettings | None:
        """The node store this pool runs, on a free loopback port; None without --host-kv-gib."""
        if self.host_kv_gib <= 0:
            return None
        return NodeStoreSettings(bind=tcp("127.0.0.1", free_port()), host_kv_gib=self.host_kv_gib,
                                 disk_kv_dir=self.disk_kv_dir, disk_kv_gib=self.disk_kv_gib)


def worker_args(pool: PoolSettings, orchestrator: OrchestratorSettings, model: str, engine: Engine,
                node_store: str = "") -> list[str]:
    return [*(["--node-store", node_store] if node_store else []),
            "--model", model, "--dtype", pool.dtype, "--kv-cache-gib", str(engine.kv_cache_gib),
            "--max-model-len", str(orchestrator.max_model_len), "--transfer-link", pool.transfer_link,
            "--orchestrator", f"tcp://127.0.0.1:{orchestrator.registry_port}",
            # Engines sharing a machine get cores of their own, not all of them each.
            *(["--omp-threads-bind", engine.cores] if engine.cores else []),
            "--pull-timeout-seconds", str(pool.pull_timeout_seconds), "--transfer-checksum", pool.transfer_checksum,
            *([] if pool.shared_copies else ["--no-shared-copies"]),
            *([] if pool.evict_pulled_first else ["--no-evict-pulled-first"]),
            *(["--long-prefill-tokens", str(pool.long_prefill_tokens)] if pool.long_prefill_tokens >= 0 else []),
            *(["--step-tokens", str(pool.step_tokens)] if pool.step_tokens else []),
            "--decoding-step-tokens", str(pool.decoding_step_tokens),
            "--decoding-tpot-target", str(pool.decoding_tpot_target), "--scheduling", pool.scheduling,
            *(["--cluster-keys", orchestrator.cluster_keys] if orchestrator.cluster_keys else ["--insecure-no-auth"]),
            "--transfer-encryption", orchestrator.transfer_encryption,
            # One trace follows a request through the orchestrator and its workers.
            *(["--otlp-endpoint", orchestrator.otlp_endpoint, "--otlp-protocol", orchestrator.otlp_protocol]
              if orchestrator.otlp_endpoint else [])]


@contextlib.contextmanager
def run_keys(orchestrator: OrchestratorSettings) -> Iterator[OrchestratorSettings]:
    """The embedded default is authenticated with no flag: without --cluster-keys (or an
    explicit --insecure-no-auth) the run gets a key folder of its own, gone when it stops."""
    if orchestrator.cluster_keys or orchestrator.insecure_no_auth:
        yield orchestrator
        return
    with cluster_keys.temporary() as folder:
        logger.info("cluster keys for this run in %s (give --cluster-keys DIR to use your own)", folder)
        yield replace(orchestrator, cluster_keys=str(folder))


def machine_topology(pool: PoolSettings) -> Topology:
    return plan_topology(pool.topology, cores=usable_cores(), gpus=gpu_count(), kv_cache_gib=pool.kv_cache_gib,
                         total_kv_gib=pool.total_kv_gib, cores_per_engine=pool.cores_per_engine)


def launch_pool(pool: PoolSettings, orchestrator: OrchestratorSettings, model: str,
                topology: Topology) -> list[LaunchedWorker]:
    """The topology's workers, after the node store they use if there is one (first in the list)."""
    log_dir = Path(pool.log_dir or tempfile.mkdtemp(prefix="kvroute-serve-"))
    started = []
    node_store = ""
    store_settings = pool.node_store_settings()
    if store_settings is not None:
        store = launch_node_store(node_store_args(store_settings, orchestrator), log_dir)
        try:
            node_store = store.wait_ready(NODE_STORE_START_SECONDS)["address"]
        except WorkerStartError:
            store.stop()
            raise
        started.append(store)
    started += [launch_worker(engine.role, worker_args(pool, orchestrator, model, engine, node_store), log_dir,
                              env=None if engine.gpu is None else {"CUDA_VISIBLE_DEVICES": str(engine.gpu)})
                for engine in topology.engines]
    logger.info("launched %d workers%s; logs in %s", len(topology.engines),
                f" and a node KV store at {node_store}" if node_store else "", log_dir)
    return started


def node_store_args(store: NodeStoreSettings, orchestrator: OrchestratorSettings) -> list[str]:
    return ["--bind", store.bind, "--host-kv-gib", str(store.host_kv_gib),
            *(["--disk-kv-dir", store.disk_kv_dir, "--disk-kv-gib", str(store.disk_kv_gib)]
              if store.disk_kv_gib else []),
            *(["--cluster-keys", orchestrator.cluster_keys] if orchestrator.cluster_keys else ["--insecure-no-auth"]),
            "--transfer-encryption", orchestrator.transfer_encryption]


async def wait_registered(fleet, workers: list[LaunchedWorker], timeout: float) -> None:
    expected = {role: sum(w.role == role for w in workers) for role in ROLES}
    deadline = asyncio.get_running_loop().time() + timeout
    while any(len(fleet.live(role)) < count for role, count in expected.items()):
        for worker in workers:
            if worker.process.poll() is not None:
                raise WorkerStartError(f"a {worker.role} worker exited; see {worker.log_path}:\n"
                                       f"{error_lines(worker.log_path)}")
        if asyncio.get_running_loop().time() > deadline:
            raise WorkerStartError(f"workers did not register within {timeout:.0f} s")
        await asyncio.sleep(0.5)


async def serve(orchestrator: OrchestratorSettings, pool: PoolSettings) -> None:
    model = resolve_model(orchestrator.model, progress=True)
    orchestrator = replace(orchestrator, model=model, registry_port=free_port())
    apps = create_apps(orchestrator)
    servers = listeners(apps, orchestrator, graceful_seconds=5)
    stop_on_signals(servers)
    api = asyncio.create_task(serve_all(servers))
    workers: list[LaunchedWorker] = []
    try:
        while not all(server.started for server in servers) and not api.done():
            await asyncio.sleep(0.1)
        if api.done():
            return
        topology = machine_topology(pool)
        apps.state.topology = topology.describe()
        logger.info("topology %s (%s): %s", topology.spec, topology.reason,
                    ", ".join(f"{e.role} on {f'GPU {e.gpu}' if e.gpu is not None else f'cores {e.cores}'} with "
                              f"{e.kv_cache_gib:g} GiB of KV" for e in topology.engines))
        workers = launch_pool(pool, orchestrator, model, topology)
        if not await _race(api, wait_registered(apps.state.fleet, workers, pool.worker_start_timeout)):
            return  # stopped (Ctrl-C) while the workers were starting
        print(f"kvroute is serving at http://{orchestrator.host}:{orchestrator.port}/v1 "
              f"(model '{apps.state.model_name}'); Ctrl-C stops it", flush=True)
        await api
    finally:
        for server in servers:
            server.should_exit = True
        await asyncio.gather(api, return_exceptions=True)
        engines = [worker for worker in workers if worker.role != NODE_STORE]
        await asyncio.to_thread(stop_all, engines)  # before the store, which they write to until they stop
        await asyncio.to_thread(stop_all, [worker for worker in workers if worker.role == NODE_STORE])
        logger.info("stopped %d workers", len(engines))


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
                        format=LOG_FORMAT)
    try:
        # uvicorn's loop="uvloop" only applies when uvicorn owns the loop; here serve() does.
        with run_keys(orchestrator) as orchestrator, asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            orchestrator.configure_security()
            orchestrator.configure_tracing()
            runner.run(serve(orchestrator, pool))
    except WorkerStartError as error:
        logger.error("%s", error)
        return 1
    finally:
        tracing.shutdown()
    return 0
