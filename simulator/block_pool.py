"""One simulated engine's KV blocks: a fixed pool with a prefix cache and LRU eviction.

Mirrors vLLM's ``BlockPool``. A block is either

* **cached**: it holds a full prompt block, is named by that block's key (the chained
  hash), and can be shared; it is *in use* while some request references it, and
  *evictable* when none does (it still counts as free, as vLLM reports it);
* **private**: held by one request, unnamed (a partial block, output tokens, a block
  being computed, or a duplicate of a block already cached).

::

    free ──allocate──▶ private ──promote(key)──▶ cached, in use ──release──▶ evictable
      ▲                   │                          ▲                        │  │
      └──────release──────┘                          └────acquire (a hit)─────┘  │
      └──────────────────────────evict (LRU, emits BlockRemoved)─────────────────┘

Eviction takes the least recently released block; requests release their blocks tail
first, so a chain's head outlives its tail. Blocks promoted ``evict_first`` (a decode
worker's pulled prompt, ``EngineConfig.evict_pulled_first``) are released to the front
of that order instead, until a hit acquires them. Invariant: ``0 <= num_used <= num_total``,
checked on every allocation. Single writer: the engine that owns the pool. Its events
(``BlockStored`` from the engine, ``BlockRemoved`` from evictions) are drained once, in
order, with ``take_events()``, as vLLM's publisher does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from foundation.identity import BlockHash
from foundation.kv_events import BlockRemoved, BlockStored, KVEvent


class CapacityError(AssertionError):
    """Blocks in use would exceed the pool: a bug in the caller, never a simulated outcome."""


class BlockPool:
    def __init__(self, num_total: int):
        if num_total < 1:
            raise ValueError("a pool needs at least one block")
        self.num_total = num_total
        self.num_used = 0  # private blocks plus cached blocks some request references
        self.max_used = 0
        self.num_evicted = 0
        self._references: dict[BlockHash, int] = {}  # every cached block → requests referencing it
        self._evictable: OrderedDict[BlockHash, None] = OrderedDict()  # cached, unreferenced; LRU first
        self._evict_first: set[BlockHash] = set()  # cached blocks released to the front of the LRU
        self._events: list[KVEvent] = []

    # ------------------------------------------------------------ reads

    @property
    def num_free(self) -> int:
        """Free blocks as vLLM reports them: never allocated, or cached and evictable."""
        return self.num_total - self.num_used

    @property
    def num_cached(self) -> int:
        return len(self._references)

    def cached_prefix(self, keys: Sequence[BlockHash], limit: int) -> int:
        """How many leading ``keys`` (at most ``limit``) are cached."""
        hit = 0
        while hit < limit and keys[hit] in self._references:
            hit += 1
        return hit

    def blocks_to_admit(self, hit_keys: Sequence[BlockHash], num_new: int) -> int:
        """Free blocks that referencing ``hit_keys`` and allocating ``num_new`` would take."""
        return num_new + sum(1 for key in hit_keys if not self._references[key])

    # ------------------------------------------------------------ writes

    def acquire(self, keys: Sequence[BlockHash]) -> None:
        """Reference cached blocks (a prefix-cache hit)."""
        for key in keys:
            if self._references[key] == 0:
                del self._evictable[key]
                self._use(1)
            self._references[key] += 1
            self._evict_first.discard(key)

    def allocate(self, count: int) -> None:
        """Take ``count`` private blocks, evicting cached ones when nothing else is free."""
        self._use(count)
        shortfall = len(self._evictable) - (self.num_total - self.num_used)
        if shortfall > 0:
            self._evict(shortfall)

    def promote(self, key: BlockHash, evict_first: bool = False) -> bool:
        """A private block now holds the full block ``key``: cache it, still in use.
        False when ``key`` is already cached (the block then stays private)."""
        if key in self._references:
            return False
        self._references[key] = 1
        if evict_first:
            self._evict_first.add(key)
        return True

    def release(self, blocks: Sequence[BlockHash | None]) -> None:
        """Drop one request's blocks (its block table: a key per cached block, None per
        private one), tail first; ``evict_first`` ones to the front, tail foremost."""
        front = []
        for key in reversed(blocks):
            if key is None:
                self.num_used -= 1
                continue
            self._references[key] -= 1
            if self._references[key] == 0:
                self._evictable[key] = None
                self.num_used -= 1
                if key in self._evict_first:
                    front.append(key)
        for key in reversed(front):
            self._evictable.move_to_end(key, last=False)

    def publish(self, event: BlockStored) -> None:
        self._events.append(event)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------ internals

    def _use(self, count: int) -> None:
        if self.num_used + count > self.num_total:
            raise CapacityError(f"{self.num_used} + {count} blocks in use exceed the pool of {self.num_total}")
        self.num_used += count
        self.max_used = max(self.max_used, self.num_used)

    def _evict(self, count: int) -> None:
        """The ``count`` least recently released cached blocks, in one event."""
        evicted = [self._evictable.popitem(last=False)[0] for _ in range(count)]
        for key in evicted:
            del self._references[key]
            self._evict_first.discard(key)
        self.num_evicted += count
        self._events.append(BlockRemoved(block_hashes=evicted))


def publish_stored(pool: BlockPool, keys: Sequence[BlockHash], token_ids: Sequence[int], start: int, end: int,
                   block_size: int) -> None:
    """Publish blocks ``start..end`` of a prompt (``keys``, its ``token_ids``) as stored, in
    one event chained to the block before them, as vLLM reports a run of newly cached blocks."""
    if start >= end:
        return
    parent = keys[start - 1] if start else None
    pool.publish(BlockStored(block_hashes=list(keys[start:end]), parent_block_hash=parent,
                             token_ids=list(token_ids[start * block_size:end * block_size]), block_size=block_size))
