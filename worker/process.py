"""One worker process: a vLLM engine, its RPC server and its heartbeats.

Start-up order: pick ports → start the engine (vLLM spawns the engine core and the
model worker, where the connector's transfer endpoint binds) → read the KV layout
from the transfer endpoint → time a prefill (``prefill_probe``) → serve RPC and
heartbeats → announce readiness. SIGTERM
drains the worker (``worker.drain``): no new requests, the running ones and
the leases they left end, then it stops; SIGINT, a second SIGTERM or ``drain_seconds``
stop it at once. Stopping ends the RPC server, then the engine; nothing is left running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import zmq

from foundation import tracing, wire, zmq_auth
from foundation.endpoint_client import PullFailed, fetch_pull_records, fetch_transfer_stats, release_all_leases
from foundation.log_setup import LOG_FORMAT
from foundation.model_fingerprint import model_fingerprint
from foundation.netutil import flush_async_context, tcp
from worker.cores import core_binding
from worker.drain import Drain, StopSignals, serve_until_stopped
from worker.engine import KV_EVENTS_TOPIC, reset_prefix_cache, start_engine
from worker.engine_stats import EngineStats
from worker.event_relay import EventRelay
from worker.heartbeat import HeartbeatSender, heartbeat_of
from worker.node_store_link import NodeStoreLink
from worker.prefill_probe import probe_prefill
from worker.prompt_priority import SHORTEST_FIRST, PromptPriorities
from worker.queued_prefill import QueuedPrompt, head_prompt_age, queued_prefill
from worker.resident import ResidentBlocks, follow
from worker.rpc_server import RpcServer
from worker.settings import WorkerSettings
from worker.status_file import status_writer

logger = logging.getLogger("kvroute.worker")
STATS_TIMEOUT = 5.0  # the transfer endpoint shares its process with a busy engine
RESET_ATTEMPTS = 50  # running requests hold blocks too; a reset waits up to ~5 s for them


class Worker:
    """Holds the engine and answers what the RPC and heartbeats ask about it."""

    def __init__(self, settings: WorkerSettings, ready_file: Path | None = None):
        self.settings = settings.with_ports()
        self.ready_file = ready_file
        self.stats = EngineStats()
        self.engine = None
        self.server: RpcServer | None = None
        self.layout: wire.KVLayoutSpec | None = None
        self.fingerprint = model_fingerprint(self.settings.model)
        self.resident = ResidentBlocks()
        self.prefill_probe: wire.PrefillProbe | None = None
        self.cores = core_binding(self.settings.omp_threads_bind)
        self._last_transfer = wire.TransferCounters()
        self.node_store = NodeStoreLink(self.settings.node_store)

    async def run(self) -> None:
        signals = StopSignals()
        relay = EventRelay(tcp(self.settings.bind_host, self.settings.kv_events_port)).start()
        self.settings = replace(self.settings, kv_events_local_address=relay.local_address)
        self.engine = start_engine(self.settings, self.stats)
        # Again now that the engine has the model: a hub model is downloaded by now, and its
        # fingerprint covers the revision it resolved to (foundation.model_fingerprint).
        self.fingerprint = model_fingerprint(self.settings.model)
        try:
            self.layout = (await self._transfer_stats(attempts=50)).layout
            self.prefill_probe = await probe_prefill(self.engine, self.settings.probe_tokens)
            # Followed only from here: the probe's blocks, gone with its cache reset, never
            # enter the resident set that snapshots (and so orchestrators' indexes) are built from.
            tasks = [asyncio.create_task(follow(self.resident, relay.local_address, KV_EVENTS_TOPIC))]
            self.server = RpcServer(self.engine, tcp(self.settings.bind_host, self.settings.rpc_port),
                                    self.worker_stats, self.snapshot, self.reset_cache, self.transfer_of,
                                    model=self.settings.model, tier_events=self.node_store.events,
                                    priority_of=self._priority_of())
            heartbeats = HeartbeatSender(self.settings.orchestrators, self.heartbeat,
                                         self.settings.orchestrator_resolve_seconds,
                                         status_writer(self.settings, self.engine_problem, self.draining))
            tasks += [asyncio.create_task(self.server.serve()),
                      asyncio.create_task(heartbeats.run(self.settings.heartbeat_seconds))]
            self._announce()
            drain = Drain(self.server, heartbeats, self.settings.drain_seconds, self.leases_settled,
                          lambda: self.release_leases("drain"))
            await serve_until_stopped(tasks, signals, drain)
            logger.info("worker %s stopping its engine", self.settings.worker_id)
        finally:
            self.engine.shutdown()
            relay.stop()

    def _priority_of(self) -> Callable[[QueuedPrompt], int] | None:
        """Each request's engine priority under --scheduling shortest-first (after the probe,
        whose rate it uses); None under vLLM's own order."""
        if self.settings.scheduling != SHORTEST_FIRST:
            return None
        priorities = PromptPriorities(self.prefill_probe)
        logger.info("waiting prompts go shortest expected prefill first (%.0f prompt tokens a second)",
                    priorities.tokens_per_second)
        return lambda prompt: priorities.of(prompt.tokens_left(self.resident))

    async def _transfer_stats(self, attempts: int = 1) -> wire.TransferStatsReply:
        for attempt in range(attempts):
            try:
                return await asyncio.to_thread(fetch_transfer_stats, zmq.Context.instance(),
                                               self.settings.transfer_address, STATS_TIMEOUT)
            except PullFailed:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.2)
        raise AssertionError("unreachable")

    def load(self) -> wire.WorkerLoad:
        config = self.engine.vllm_config.cache_config
        total = config.num_gpu_blocks or 0
        used = round(self.stats.kv_cache_usage * total)
        waiting = self.server.prompts_waiting if self.server else {}
        queued = queued_prefill(waiting, self.resident)
        return wire.WorkerLoad(
            num_running=self.stats.num_running, num_waiting=self.stats.num_waiting,
            num_queued_prefill_tokens=sum(queued.values()), queued_prefill=queued,
            prompt_step_cap=self.settings.long_prefill_step_tokens,
            head_prompt_age=head_prompt_age(waiting, self.stats.last_step_end, time.monotonic()),
            num_free_blocks=total - used, num_total_blocks=total,
            block_size=config.block_size, bytes_per_block=self.layout.bytes_per_block if self.layout else 0)

    def heartbeat(self, now: float) -> wire.Heartbeat:
        return heartbeat_of(self.settings, self.load(), self.fingerprint, now, draining=self.draining(),
                            prefill_probe=self.prefill_probe, cores=self.cores)

    def draining(self) -> bool:
        return self.server is not None and self.server.draining

    def engine_problem(self) -> str:
        """Why the engine cannot serve (vLLM's engine core died), or "" when it can."""
        return "the vLLM engine core is dead" if self.engine.errored else ""

    def snapshot(self, request_id: str) -> wire.KVSnapshot:
        return self.resident.snapshot(request_id, self.settings.incarnation)

    async def transfer_of(self, request_id: str) -> wire.PullRecord | None:
        """The pull that brought ``request_id``'s prompt blocks, as the connector recorded it."""
        try:
            records = await asyncio.to_thread(fetch_pull_records, zmq.Context.instance(),
                                              self.settings.transfer_address, request_id)
        except PullFailed:
            return None
        return records[-1] if records else None

    async def leases_settled(self) -> bool:
        """Whether every lease this worker handed out has ended (pulled, released, expired).
        A grant reaches the connector at the engine's next step after its pull source went out, so
        a count of held leases alone could miss one still on its way."""
        sent = self.server.num_pull_sources_sent
        if sent == 0:
            return True
        try:
            counters = (await self._transfer_stats()).counters
        except PullFailed:
            return False  # ask again; the drain's deadline bounds the wait
        return counters.leases_granted >= sent and counters.active_leases == 0

    async def release_leases(self, reason: str) -> int:
        return await asyncio.to_thread(release_all_leases, zmq.Context.instance(),
                                       self.settings.transfer_address, reason)

    async def reset_cache(self, request_id: str) -> wire.ResetCacheReply:
        """Release leases, then reset the prefix cache once vLLM has freed their blocks; the
        node store, if any, is emptied too."""
        released = await self.release_leases("reset")
        store = await self.node_store.reset_fields()
        if not await reset_prefix_cache(self.engine, RESET_ATTEMPTS):
            return wire.ResetCacheReply(request_id=request_id, reset=False, released_leases=released, **store)
        self.resident.clear()
        logger.info("prefix cache reset (%d leases released)", released)
        return wire.ResetCacheReply(request_id=request_id, reset=True, released_leases=released, **store)

    async def worker_stats(self) -> wire.WorkerStats:
        """Load and counters; if the (busy) transfer endpoint is slow, its last known counters."""
        fresh = True
        try:
            self._last_transfer = (await self._transfer_stats()).counters
        except PullFailed as error:
            logger.warning("transfer endpoint slow (%s); reporting its last known counters", error)
            fresh = False
        transfer = self._last_transfer
        return wire.WorkerStats(worker_id=self.settings.worker_id, role=self.settings.role,
                                incarnation=self.settings.incarnation, load=self.load(),
                                transfer=transfer, transfer_fresh=fresh, prompt_tokens=self.stats.prompt_tokens(),
                                num_active_requests=self.server.num_active_requests if self.server else 0,
                                **await self.node_store.stats_fields())

    def _announce(self) -> None:
        info = {"worker_id": self.settings.worker_id, "role": self.settings.role,
                "incarnation": self.settings.incarnation, "rpc_address": self.settings.rpc_address,
                "model_fingerprint": self.fingerprint,
                "kv_events_address": self.settings.kv_events_address,
                "transfer_address": self.settings.transfer_address,
                "bytes_per_block": self.layout.bytes_per_block, "ready_at": time.time(),
                "prefill_probe": wire.to_dict(self.prefill_probe) if self.prefill_probe else None}
        logger.info("worker ready: %s", json.dumps(info))
        if self.ready_file is not None:
            tmp = self.ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(info))
            tmp.replace(self.ready_file)


def run_worker(settings: WorkerSettings, ready_file: Path | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    zmq_auth.configure_from_flags(settings.cluster_keys, settings.insecure_no_auth, "worker",
                                  settings.transfer_encryption)
    settings = settings.with_ports()  # its worker id names it in traces
    settings.configure_tracing()
    try:
        asyncio.run(Worker(settings, ready_file).run())
    finally:
        flush_async_context()
        tracing.shutdown()  # the last spans are exported, not lost
