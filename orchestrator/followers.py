"""How much of a prefix still being computed a request that follows it will reuse.

A claimed block (``pending_blocks``) is one that a request routed to the worker is about
to compute. A request with the same prefix sent to the same worker reuses it only if
the engine has made it hittable by the time it schedules the follower, and vLLM makes a
block hittable when the chunk holding it is scheduled (``KVCacheManager.allocate_slots``).
So, for the claimant of the first prompt block the worker has not reported stored:

* its prefill is over (it is no longer queued there): its blocks are stored, their KV
  events have not arrived yet; the follower reuses them all;
* it is the oldest prompt queued there, or the engine serves prompts in turn: the
  follower waits for all of it (the queue-wait estimate waits for the oldest in full as
  well: a lone prompt gets the whole step) and reuses it all;
* it is queued behind another prompt on an engine that shares its steps between
  prompts (a per-prompt step cap): when the oldest's step ends, claimant and follower
  are scheduled in the same step, each a chunk of at most the cap. The follower finds
  what the claimant has already stored (its KV events report it) and the one chunk
  scheduled just before its own, and computes the rest itself. Measured in a real
  replay (step cap 256): a follower priced at 1,312 reused tokens reused 256.
"""

from __future__ import annotations

from collections.abc import Sequence

from foundation.identity import BlockHash
from orchestrator.index import PrefixIndex


def followable_blocks(index: PrefixIndex, worker_id: str, block_hashes: Sequence[BlockHash], matched: int,
                      queue_order: Sequence[str], step_cap_tokens: int, block_size: int) -> int:
    """Of the ``matched`` leading blocks the index credits ``worker_id`` with (stored or
    claimed), how many a request sent there now would reuse. ``queue_order``: the request
    ids of the prompts queued there, oldest first; ``step_cap_tokens``: the most prompt
    tokens its engine gives one prompt a step (0: prompts take whole steps in turn)."""
    if matched == 0 or step_cap_tokens <= 0 or len(queue_order) < 2:
        return matched
    stored = index.stored_prefix(worker_id, block_hashes[:matched])
    if stored >= matched:
        return matched
    behind_the_oldest = set(queue_order[1:])
    claimants = index.claimants(worker_id, block_hashes[stored])
    if not claimants or not claimants <= behind_the_oldest:
        return matched
    return min(matched, stored + step_cap_tokens // block_size)
