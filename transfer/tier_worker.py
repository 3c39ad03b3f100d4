"""The worker half's dealings with the node KV tier (``transfer.node_store``): writing a
finished request's new blocks through, and loading a prompt's blocks back.

Writing through (``save``) gathers the blocks out of the cache on the engine's thread, at
the start of the step after the request finished and before that step's forward pass,
which is the last moment vLLM's freed blocks are sure to hold them; the put to the store
then runs on a connector thread, and its memfd is closed when the store has answered. A
put that fails is logged and counted, never more: the request has already finished.

Loading back (``load``) runs on a connector thread into blocks vLLM allocated for it; any
failure raises, and the connector reports the load failed, so vLLM recomputes the prompt.
Only host-memory caches take part (a CUDA cache would need a device copy first).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor

from foundation.log_limits import PeerWarnings
from transfer.counters import Counters
from transfer.kv_layout import PagedKVCache
from transfer.memfd import local_host
from transfer.metadata import TierLoad, TierSave
from transfer.node_store.cache_io import StagingPool, TierCopy, read_blocks
from transfer.node_store.client import NodeStoreClient, StoreRefused, StoreUnavailable

logger = logging.getLogger("kvroute.transfer.tier")


class TierWorker:
    """``save`` on the engine's thread; ``load`` and the puts on the connector's threads."""

    def __init__(self, client: NodeStoreClient, counters: Counters, pool: Executor, shared_memory: bool):
        self.client = client
        self.counters = counters
        self._pool = pool
        self._host = local_host() if shared_memory else ""
        self._warnings = PeerWarnings(logger)
        self._warnings_lock = threading.Lock()  # puts fail on either connector thread
        self._staging = StagingPool()
        self.cache: PagedKVCache | None = None

    def attach(self, cache: PagedKVCache) -> None:
        if cache.is_host_memory and all(layer.is_contiguous() for layer in cache.layers):
            self.cache = cache
            logger.info("node KV store at %s: new blocks are written through, prompts load what it holds",
                        self.client.address)
        else:
            logger.warning("the node KV store needs a contiguous host-memory KV cache; not using %s",
                           self.client.address)

    def save(self, save: TierSave) -> None:
        if self.cache is None or not self.client.available:
            return
        started = time.perf_counter()
        try:
            copy = self._staging.stage(self.cache, list(save.block_ids))
        except Exception:  # the request has finished: nothing to fail but the write-through
            logger.exception("staging request %s's blocks for the node store failed", save.request_id)
            self.counters.add(tier_saves_failed=1)
            return
        nbytes = len(save.block_ids) * self.cache.spec.bytes_per_block
        self.counters.add(tier_saves_staged=1, tier_bytes_staged=nbytes,
                          tier_stage_microseconds=round((time.perf_counter() - started) * 1e6))
        self._pool.submit(self._put, save, copy)

    def _put(self, save: TierSave, copy: TierCopy) -> None:
        nbytes = len(save.block_ids) * self.cache.spec.bytes_per_block
        try:
            reply = self.client.put(list(save.keys), self.cache.spec, copy.ref(len(save.keys)),
                                    memoryview(copy.mapping)[:nbytes])
        except (StoreUnavailable, StoreRefused) as error:
            copy.close()  # a store that gave up on it may still be reading it: never reused
            with self._warnings_lock:
                self._warnings.warn(self.client.address, "writing blocks through to the node store failed: %s", error)
            self.counters.add(tier_saves_failed=1)
            return
        self._staging.give_back(copy)
        self.counters.add(tier_saves=1, tier_blocks_written=reply.stored)

    def close(self) -> None:
        self.client.close()
        self._staging.close()

    def load(self, load: TierLoad) -> int:
        """Read the load's blocks into the cache; the bytes read. Raises on any failure."""
        if self.cache is None:
            raise StoreUnavailable("this cache does not take blocks from the node store")
        started = time.perf_counter()
        reply, frames = self.client.get(list(load.keys), self.cache.spec, self._host)
        nbytes = read_blocks(reply, frames, self.cache, list(load.local_block_ids))
        self.counters.add(tier_blocks_loaded=len(load.keys), tier_bytes_loaded=nbytes,
                          tier_load_microseconds=round((time.perf_counter() - started) * 1e6))
        return nbytes
