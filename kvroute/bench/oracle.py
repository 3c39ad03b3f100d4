"""How many prompt tokens a workload could reuse at best: the bounds placement is judged by.

Two bounds, over requests in arrival order, each a prompt length and the keys of its
full KV blocks (a key stands for the block's whole prefix, as chained hashes do):

* **unlimited**: one shared cache that never evicts. A request's hit is the longest
  prefix of its block chain that any earlier request had.
* **shared LRU**: one shared prefix cache of ``capacity_blocks`` blocks, with perfect
  routing (every request sees the whole cache). After its hit is counted, a request's
  blocks become the most recently used, its first block most of all: blocks are touched
  tail first, so eviction takes the tails of old chains before their heads, as vLLM's
  free queue does, and a cached chain stays a prefix.

Both count what an engine can skip: whole blocks only (a partial last block is never
cached), and never the prompt's last token, which vLLM always recomputes to sample from;
so at most ``(prompt_tokens - 1) // block_size`` blocks of a prompt are hits. They
ignore timing (a request may hit blocks another is still computing) and count cached
blocks only, not the room running requests need: both are bounds, not predictions.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from workloads.trace import TraceRequest

BlockKey = Hashable


@dataclass(frozen=True)
class OracleRequest:
    prompt_tokens: int
    block_keys: tuple[BlockKey, ...]  # the prompt's full blocks, in order


@dataclass(frozen=True)
class Reuse:
    prompt_tokens: int
    reused_tokens: int
    per_request: tuple[int, ...]  # reused tokens of each request, in order

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class ReuseBounds:
    unlimited: Reuse
    lru: Reuse
    capacity_blocks: int
    block_size: int


def hittable_blocks(request: OracleRequest, block_size: int) -> int:
    return min(len(request.block_keys), max(0, (request.prompt_tokens - 1) // block_size))


def _prefix_hit(keys: Sequence[BlockKey], limit: int, cached) -> int:
    hit = 0
    while hit < limit and keys[hit] in cached:
        hit += 1
    return hit


def _reuse(requests: Sequence[OracleRequest], hits: list[int], block_size: int) -> Reuse:
    per_request = tuple(hit * block_size for hit in hits)
    return Reuse(sum(r.prompt_tokens for r in requests), sum(per_request), per_request)


def unlimited_reuse(requests: Iterable[OracleRequest], block_size: int) -> Reuse:
    requests = list(requests)
    seen: set[BlockKey] = set()
    hits = []
    for request in requests:
        hits.append(_prefix_hit(request.block_keys, hittable_blocks(request, block_size), seen))
        seen.update(request.block_keys)
    return _reuse(requests, hits, block_size)


def lru_reuse(requests: Iterable[OracleRequest], block_size: int, capacity_blocks: int) -> Reuse:
    if capacity_blocks < 0:
        raise ValueError("capacity_blocks must be >= 0")
    requests = list(requests)
    cache: OrderedDict[BlockKey, None] = OrderedDict()  # least recently used first
    hits = []
    for request in requests:
        hits.append(_prefix_hit(request.block_keys, hittable_blocks(request, block_size), cache))
        for key in reversed(request.block_keys):
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return _reuse(requests, hits, block_size)


def reuse_bounds(requests: Iterable[OracleRequest], block_size: int, capacity_blocks: int) -> ReuseBounds:
    requests = list(requests)
    return ReuseBounds(unlimited_reuse(requests, block_size), lru_reuse(requests, block_size, capacity_blocks),
                       capacity_blocks, block_size)


# ---------------------------------------------------------------- from a scaled trace


def trace_block_keys(request: TraceRequest, block_size: int) -> tuple[BlockKey, ...]:
    """Keys of the full ``block_size``-token blocks of a scaled trace request.

    A block's key is (hash id of the trace block holding its last token, offset of that
    token in it): trace ids are chained, so that pair names the whole prefix up to the
    block's end, for any block size, without generating a token."""
    trace_block = request.content.block_tokens
    ends = range(block_size - 1, request.prompt_tokens, block_size)
    return tuple((request.hash_ids[end // trace_block], end % trace_block) for end in ends)


def oracle_requests(trace: Iterable[TraceRequest], block_size: int) -> list[OracleRequest]:
    """The trace in arrival order (ties in trace order), as the oracle reads it."""
    ordered = sorted(trace, key=lambda request: (request.arrival_seconds, request.index))
    return [OracleRequest(r.prompt_tokens, trace_block_keys(r, block_size)) for r in ordered]
