"""Building the vLLM engine a worker hosts: prefix caching, KV events, our connector."""

from __future__ import annotations

import asyncio
import logging

import torch
from vllm import AsyncEngineArgs
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.v1.engine.async_llm import AsyncLLM

from foundation.netutil import tcp
from worker.block_size import resolve_here as resolve_block_size
from worker.decode_guard import decode_guard_args, decode_guard_summary
from worker.engine_stats import EngineStats
from worker.prompt_priority import engine_policy
from worker.settings import WorkerSettings

logger = logging.getLogger("kvroute.worker.engine")

# A unified worker's engine both lends its prompts' blocks and pulls the ones it lacks.
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer", "unified": "kv_both"}
KV_EVENTS_TOPIC = "kv-events"


def kv_transfer_config(settings: WorkerSettings) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="KVRouteConnector",
        kv_connector_module_path="transfer.connector",
        kv_role=KV_ROLE[settings.role],
        # A failed pull must never lose the request: recompute on this worker instead.
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "transfer_bind": tcp(settings.bind_host, settings.transfer_port),
            "transfer_address": settings.transfer_address,
            "lease_seconds": settings.lease_seconds,
            "staging_bytes": int(settings.lease_staging_gib * 2**30),
            "transfer_cpus": settings.transfer_cpus,
            "pull_timeout_seconds": settings.pull_timeout_seconds,
            "transfer_link": settings.transfer_link,
            "transfer_link_hosts": settings.transfer_link_hosts,
            "shared_copies": settings.shared_copies,
            "evict_pulled_first": settings.evict_pulled_first,
            "cluster_keys": settings.cluster_keys,
            "insecure_no_auth": settings.insecure_no_auth,
            "transfer_encryption": settings.transfer_encryption,
            "transfer_checksum": settings.transfer_checksum,
            "node_store": settings.node_store,
        },
    )


def local_events_address(settings: WorkerSettings) -> str:
    if not settings.kv_events_local_address.startswith("ipc://"):
        raise ValueError("the engine's KV events need a private ipc:// address (worker.event_relay), "
                         f"got {settings.kv_events_local_address!r}")
    return settings.kv_events_local_address


def kv_events_config(settings: WorkerSettings) -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        # vLLM binds wildcard and ipc endpoints and *connects* to any other address. It binds
        # in clear, so an ipc socket in a private folder; worker.event_relay republishes the
        # events on the advertised port under the cluster's keys.
        endpoint=local_events_address(settings),
        topic=KV_EVENTS_TOPIC,
    )


def engine_args(settings: WorkerSettings) -> AsyncEngineArgs:
    return AsyncEngineArgs(
        model=settings.model,
        dtype=settings.dtype,
        enforce_eager=settings.enforce_eager,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=int(settings.kv_cache_gib * 2**30),
        block_size=resolve_block_size(settings.block_size),
        max_model_len=settings.max_model_len,
        seed=settings.seed,
        long_prefill_token_threshold=settings.long_prefill_step_tokens,
        max_num_batched_tokens=settings.step_tokens,
        scheduling_policy=engine_policy(settings.scheduling),
        **decode_guard_args(settings.decoding_step_tokens, settings.decoding_tpot_target, torch.cuda.is_available()),
        kv_transfer_config=kv_transfer_config(settings),
        kv_events_config=kv_events_config(settings),
        disable_log_stats=False,
    )


def start_engine(settings: WorkerSettings, stats: EngineStats) -> AsyncLLM:
    """Start the engine (tens of seconds on CPU); vLLM spawns its own processes."""
    settings.apply_environment()
    logger.info("starting vLLM engine for %s (%s, %s)", settings.worker_id, settings.model, settings.dtype)
    args = engine_args(settings)
    logger.info("steps beside decoding requests: %s", decode_guard_summary(args.additional_config))
    return AsyncLLM.from_engine_args(args, stat_loggers=[stats.logger_factory()])


async def reset_prefix_cache(engine: AsyncLLM, attempts: int) -> bool:
    """Empty the engine's prefix cache; True once it did. vLLM refuses while blocks are still
    referenced, and freed blocks return to the pool on its next step, so try ``attempts``
    times, 0.1 s apart."""
    for _ in range(attempts):
        if await engine.reset_prefix_cache():
            return True
        await asyncio.sleep(0.1)
    return False
