"""The worker half of the kvroute connector (runs in vLLM's model-worker process).

It owns the transfer endpoint (``BlockServer``, whose thread also expires leases) beside
the KV cache, the lease table of a producer (leases are staged to host buffers when the
budget allows, so the engine frees its blocks at once; see ``transfer.leases``), and the
pulls of a consumer. Pulls run on a small thread pool and write only into blocks vLLM
allocated for them; vLLM does not read those blocks until the pull is reported finished.
A failed pull is reported as failed, and vLLM (``kv_load_failure_policy="recompute"``)
computes the prompt locally instead. That includes a pull whose producer answered with
a header that disagrees with it (``transfer.pull_check``: refused before anything is
written) and one whose frame failed its checksum (refused before that frame is stored).

With a node store, the tier's loads and write-throughs run beside them
(``transfer.tier_worker``): a load from the tier completes or fails like a pull.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from foundation.endpoint_client import ChannelPool, PullFailed, release_lease
from foundation.wire import PullRecord
from transfer.affinity import pin_current_thread, transfer_context, transfer_cpus
from transfer.block_client import pull_blocks
from transfer.block_server import BlockServer
from transfer.counters import Counters
from transfer.direct_reads import DIRECT, DirectReader
from transfer.idle_spin import shorten_idle_spin
from transfer.kv_layout import PagedKVCache, block_index_tensor
from transfer.leases import Lease, LeaseTable
from transfer.link_control import ConsumerLink, open_consumer_link, pull_over_link
from transfer.metadata import KVRouteConnectorMetadata, LoadSpec, TierLoad
from transfer.node_store.client import NodeStoreClient
from transfer.pull_check import CorruptFrame, PullRefused
from transfer.pull_records import PullRecords
from transfer.settings import ConnectorSettings
from transfer.shared_copies import SUPPORTED as SHARED_COPIES_SUPPORTED
from transfer.shared_copies import read_shared_copy, stage_shared
from transfer.staging_arena import StagingArena, stage_in_arena, staging_arena
from transfer.tier_worker import TierWorker
from transfer.transports.handshake import RECEIVER, SENDER
from transfer.transports.links import LinkTable
from transfer.transports.nixl_agent import agent_for, nixl_missing
from transfer.transports.settings import AUTO

logger = logging.getLogger("kvroute.transfer.worker")

GIL_SWITCH_INTERVAL_SECONDS = 0.0002
IDLE_POLL_WAIT_SECONDS = 0.01


class ConnectorWorker:
    """Engine-thread methods: register, start, take_results. Pull threads only append
    to the result sets under ``_lock``."""

    def __init__(self, settings: ConnectorSettings, num_blocks: int, block_size: int):
        self.settings = settings
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.leases = LeaseTable()
        self.counters = Counters()
        self.pull_records = PullRecords()
        self.cache: PagedKVCache | None = None
        self.server: BlockServer | None = None
        cpus = transfer_cpus(settings.transfer_cpus)
        self._context = transfer_context(cpus)
        self._channels = ChannelPool(self._context)  # to producers' endpoints, one per pull thread
        self._links: LinkTable[ConsumerLink] = LinkTable(self._open_link)  # by producer address
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvroute-pull",
                                        initializer=pin_current_thread, initargs=(cpus,))
        self._cpus = cpus
        self._lock = threading.Lock()
        self._finished_loads: set[str] = set()
        self._failed_loads: set[str] = set()
        self._load_ended = threading.Event()
        self._active_loads = 0
        self._idle_step = False
        self._shares_copies = settings.shared_copies and SHARED_COPIES_SUPPORTED
        self._reads_shared_copies = False  # known once the caches are registered
        self._direct: DirectReader | None = None  # with a nixl link, on a host cache: see register
        # Where leases are staged (see _stages_in_arena); made at the first lease, so that an
        # end that only consumes maps none.
        self._arena: StagingArena | None = None
        self._tier: TierWorker | None = None
        if settings.node_store:
            self._tier = TierWorker(NodeStoreClient(settings.node_store, self._context), self.counters,
                                    self._pool, self._shares_copies)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # The block server and pull threads share the GIL with vLLM's model-runner thread,
        # which polls for work without pause while requests wait on transfers. At Python's
        # default 5 ms switch interval each of a pull's per-layer GIL handoffs (~2 per
        # layer) can wait 5 ms: ~100 ms per pull however small. 0.2 ms bounds that to ~10 ms.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_SECONDS)
        self.cache = PagedKVCache(list(kv_caches.values()), self.num_blocks, self.block_size)
        self._reads_shared_copies = (self._shares_copies and self.cache.is_host_memory
                                     and self.cache.layers[0].is_contiguous())
        if self._reads_directly():
            self._direct = DirectReader(self.cache, self.settings.link_settings().host)
        self._warm_nixl_agents()
        self.server = BlockServer(self.settings.transfer_bind, self.cache, self.leases,
                                  self.counters, self.settings.park_seconds, self.pull_records,
                                  context=self._context, cpus=self._cpus,
                                  link_settings=self.settings.link_settings(),
                                  max_parked=self.settings.max_parked_pulls)
        self.server.start()
        if self._tier is not None:
            self._tier.attach(self.cache)
        shortened = shorten_idle_spin(self.settings.idle_spin_seconds)
        logger.info("kvroute transfer endpoint on %s (layout %s), transfer threads on CPUs %s; "
                    "%d command queue(s) spin at most %.3f s after a command",
                    self.settings.transfer_bind, self.cache.spec, self._cpus, shortened,
                    self.settings.idle_spin_seconds)

    def _reads_directly(self) -> bool:
        """Where this end's links may run nixl (forced, or "auto" measuring it), pulls of staged
        leases can be READ straight into a contiguous host cache (``transfer.direct_reads``;
        which pulls: ``_reads_directly_from``); other caches take the links' frames."""
        cache = self.cache
        return (self.settings.transfer_link in (AUTO, "nixl") and not nixl_missing() and cache.is_host_memory
                and all(layer.is_contiguous() for layer in cache.layers))

    def _reads_directly_from(self, address: str) -> bool:
        """Whether pulls from the producer at ``address`` READ its staged leases directly:
        always with nixl forced; under "auto" where the link to it chose nixl by measurement
        (opening that link on the first pull), since nixl's one-sided READ of the staged lease
        is that link's own mechanism without the frames in between."""
        if self._direct is None:
            return False
        return self.settings.transfer_link == "nixl" or self._links.get(address).receiver.backend == "nixl"

    def _stages_in_arena(self) -> bool:
        """Every producer with a host-memory cache stages its leases into this process's
        staging arena: memory staged into once is reused without faulting again, where a
        fresh shared copy per lease faults in every page (measured here for 47 MB of float32
        KV: 34 ms into a new memfd, 2.3 ms into the arena; 189 MB: 134 against 8.5 ms), on the
        engine's step. Consumers on this host read a region as a shared copy and confirm it;
        those with nixl READ it directly (``transfer.direct_exports``, where this end hosts
        nixl); others get frames. The arena keeps the pages it was staged into, up to the
        peak of leases staged at once (first fit from its start), within staging_bytes."""
        return self.cache.is_host_memory and self.settings.staging_bytes > 0

    def _arena_is_shareable(self) -> bool:
        """Whether consumers may open the arena as a file: not where this end forces nixl, so
        that every consumer READs it (links of both ends force the same backend); the arena
        is then anonymous memory in huge pages, which NIXL READs faster than any file
        (``transfer.staging_arena``)."""
        return not (self.settings.transfer_link == "nixl" and not nixl_missing())

    def _warm_nixl_agents(self) -> None:
        """Make this process's NIXL agents while the engine starts, when its links may run
        nixl ("auto" measures it, or it is forced): the first agent of a process costs ~0.45 s
        (UCX starting), which would otherwise fall on the first pull between two workers."""
        if self.settings.transfer_link not in (AUTO, "nixl") or nixl_missing():
            return
        host = self.settings.link_settings().host
        try:
            for role in (SENDER, RECEIVER, DIRECT):
                agent_for(role, host)
        except Exception as error:  # noqa: BLE001 - links then find nixl cannot run, and say so
            logger.warning("could not make this process's NIXL agents ahead of its links: %s", error)

    def start(self, metadata: KVRouteConnectorMetadata) -> None:
        now = time.monotonic()
        self._idle_step = metadata.idle_step
        for save in metadata.tier_saves:  # first: this step may hand their blocks to other requests
            self._tier.save(save)
        for grant in metadata.grants:
            lease = Lease(grant.handle, grant.request_id, grant.block_ids, grant.num_tokens,
                          now + self.settings.lease_seconds)
            staging_bytes = self._staging_room(len(grant.block_ids))
            self.leases.grant(lease, staging_bytes=staging_bytes)
            if staging_bytes:
                # On the engine's own thread: a few milliseconds of copying, where a helper
                # thread would wait for the GIL at every layer (see ``register``).
                self._stage(lease)
        for load in metadata.loads:
            self._begin_load()
            self._pool.submit(self._pull, load)
        for tier_load in metadata.tier_loads:
            self._begin_load()
            self._pool.submit(self._load_from_tier, tier_load)
        for source, reason in metadata.releases:
            self._pool.submit(release_lease, self._context, source.address, source.handle, reason,
                              channels=self._channels)

    def _staging_room(self, num_blocks: int) -> int:
        """Bytes to stage a lease of ``num_blocks`` blocks, or 0 to keep it in place."""
        assert self.cache is not None, "KV caches were never registered"
        nbytes = num_blocks * self.cache.spec.bytes_per_block
        if not self.cache.is_host_memory or self.leases.staged_bytes + nbytes > self.settings.staging_bytes:
            return 0
        return nbytes

    def _stage(self, lease: Lease) -> None:
        """Copy a lease's blocks out of the engine's cache so the engine can free them: into
        the staging arena (``_stages_in_arena``) while it has room; else into a shared copy of
        its own, which consumers on this host read directly, when it can be had."""
        block_ids = block_index_tensor(lease.block_ids)
        layers, shared, region = None, None, None
        try:
            if self._arena is None and self._stages_in_arena():
                self._arena = staging_arena(self.settings.staging_bytes, self._arena_is_shareable())
                logger.info("staging leases into an arena of %.0f MiB (%s)", self._arena.nbytes / 2**20,
                            "huge pages, for NIXL READs" if self._arena.huge_pages else
                            "a shared file" if self._arena.shared else "private memory")
            if self._arena is not None:
                layers, region = stage_in_arena(self.cache, block_ids, self._arena) or (None, None)
            if layers is None and self._shares_copies:
                try:
                    layers, shared = stage_shared(self.cache, block_ids)
                except OSError as error:  # e.g. out of descriptors: a private copy still frees the blocks
                    logger.warning("no shared copy for request %s's lease (%s); staging it privately",
                                   lease.request_id, error)
            if layers is None:
                layers = self.cache.copy_blocks(block_ids)
        except Exception:  # the lease stays in place and is still served
            logger.exception("staging the lease of request %s failed; holding its blocks", lease.request_id)
            layers = None
        self.leases.finish_staging(lease.handle, layers, shared, region)

    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving), each reported once."""
        self._wait_while_only_polling()
        finished_sending = self.leases.take_ended_request_ids()
        with self._lock:
            finished, self._finished_loads = self._finished_loads, set()
            failed, self._failed_loads = self._failed_loads, set()
        return finished_sending, finished | failed, failed

    def _pull(self, load: LoadSpec) -> None:
        started = (time.time(), time.perf_counter())  # when, for traces; and how long, precisely
        try:
            nbytes = self._pull_into_cache(load)
            self._record(load, nbytes, started, ok=True)
            self.counters.add(bytes_received=nbytes, blocks_received=len(load.local_block_ids), pulls_ok=1)
        except Exception as error:  # any failure falls back to recompute, never a lost request
            logger.warning("pull for request %s failed (%s); recomputing locally", load.request_id, error)
            self._record(load, 0, started, ok=False)
            self.counters.add(pulls_failed=1, pulls_refused=int(isinstance(error, PullRefused)),
                              checksum_failures=int(isinstance(error, CorruptFrame)))
            self._finish(load.request_id, failed=True)
            return
        self._finish(load.request_id, failed=False)  # the request runs on; the ack need not wait
        if not release_lease(self._context, load.source.address, load.source.handle, "ack",
                             channels=self._channels):
            logger.warning("producer %s did not confirm the release of request %s's lease; it frees the "
                           "blocks when the lease expires", load.source.address, load.request_id)

    def _load_from_tier(self, load: TierLoad) -> None:
        try:
            self._tier.load(load)
        except Exception as error:  # any failure falls back to recompute, never a lost request
            logger.warning("loading request %s's prompt from the node store failed (%s); recomputing it",
                           load.request_id, error)
            self.counters.add(tier_loads_failed=1)
            self._finish(load.request_id, failed=True)
            return
        self.counters.add(tier_loads_ok=1)
        self._finish(load.request_id, failed=False)

    def _begin_load(self) -> None:
        self.counters.add(active_pulls=1)
        with self._lock:
            self._active_loads += 1

    def _record(self, load: LoadSpec, nbytes: int, started: tuple[float, float], ok: bool) -> None:
        started_at, started_counter = started
        self.pull_records.add(PullRecord(request_id=load.request_id, source=load.source.address,
                                         num_bytes=nbytes, seconds=time.perf_counter() - started_counter, ok=ok,
                                         started_at=started_at))

    def _pull_into_cache(self, load: LoadSpec) -> int:
        assert self.cache is not None, "KV caches were never registered"
        cache = self.cache
        local = block_index_tensor(load.local_block_ids)
        deadline = time.monotonic() + self.settings.pull_timeout_seconds

        def store(layer: int, data: torch.Tensor) -> None:
            cache.scatter_layer(layer, local, data)
            self.counters.add(bytes_scattered=data.numel())

        if self._reads_directly_from(load.source.address):
            return pull_blocks(self._context, load.source, load.remote_indices, cache.spec, store, deadline,
                               self._channels, checksum=self.settings.transfer_checksum,
                               read_direct=self._direct_reader(load, deadline))
        if not self.settings.uses_links:
            return pull_blocks(self._context, load.source, load.remote_indices, cache.spec, store, deadline,
                               self._channels, read_shared=self._shared_reader(load),
                               checksum=self.settings.transfer_checksum)
        link = self._links.get(load.source.address)
        return pull_over_link(self._context, load.source, load.remote_indices, cache.spec, link, store, deadline,
                              self._channels, checksum=self.settings.transfer_checksum)

    def _direct_reader(self, load: LoadSpec, deadline: float):
        """READs a producer's staged copy into this load's blocks with NIXL."""
        def read(ref) -> int:
            nbytes = self._direct.read(ref, list(load.local_block_ids), list(load.remote_indices), deadline)
            self.counters.add(direct_pulls=1)
            return nbytes
        return read

    def _shared_reader(self, load: LoadSpec):
        """Reads a producer's shared copy into this load's blocks, if this cache can take it."""
        if not self._reads_shared_copies:
            return None
        cache = self.cache

        def read(ref) -> int:
            nbytes = read_shared_copy(ref, cache, load.local_block_ids, load.remote_indices)
            self.counters.add(shared_pulls=1)
            return nbytes
        return read

    def _open_link(self, address: str) -> ConsumerLink:
        assert self.cache is not None, "KV caches were never registered"
        link = open_consumer_link(self._context, address, self.cache.spec, self.cache.device,
                                  self.settings.link_settings())
        logger.info("opened a %s link from %s", link.receiver.backend, address)
        self.counters.add(links_opened=1)
        if link.receiver.measurement is not None:
            self.counters.record_measurement(link.receiver.measurement)
        return link

    def _finish(self, request_id: str, failed: bool) -> None:
        """Report a load done; an exception after this must not report it again."""
        self.counters.add(active_pulls=-1)
        with self._lock:
            (self._failed_loads if failed else self._finished_loads).add(request_id)
            self._active_loads -= 1
        self._load_ended.set()

    def _wait_while_only_polling(self) -> None:
        """In a step that computes nothing, wait briefly for a pull to end instead of
        returning at once. vLLM re-polls without pause while requests wait for their KV,
        and that loop would take the core (and the GIL) from the pulls it waits on; a
        pull that ends wakes the wait at once, so completions are not delayed."""
        with self._lock:
            waiting = self._idle_step and self._active_loads > 0 and not self._finished_loads and not self._failed_loads
            self._load_ended.clear()
        if waiting:
            self._load_ended.wait(IDLE_POLL_WAIT_SECONDS)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._tier is not None:
            self._tier.close()
        self._links.close_all()
        self._channels.close()
        if self.server is not None:
            self.server.stop()
        if self._direct is not None:
            self._direct.close()


__all__ = ["ConnectorWorker", "PullFailed"]
