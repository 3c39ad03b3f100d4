"""Prompt blocks a worker is about to compute: claimed when a request is routed there.

The index learns of a block only when the engine reports it stored, after the request
that computes it was queued and prefilled. A request with the same prefix that arrives
meanwhile would see a cold fleet and recompute the prefix elsewhere. So when a request
is routed, its prompt blocks are *claimed* on its prefilling worker, and the index
counts a claimed block as held there: the next request with that prefix is priced as a
hit behind the first (its queue wait already counts the first request's prefill).

A claim on a block ends when
* the worker reports the block stored (``confirm``): from then on the index follows it,
  evictions included;
* the request's prefill is done (``settle``): its blocks are stored by then; the rest
  of its claim lasts ``settle_grace_seconds`` more, for KV events that trail the token;
* the request ends without a first token (``release``): it stored nothing we can count on;
* it is older than ``max_age_seconds`` (``expire``): a bound for claims nobody settled;
* the worker is purged (``drop_worker``): it died, restarted or had its cache reset.

A worker's claims never exceed its KV capacity: a claim that would push them over it
pushes out the worker's oldest claims first (their blocks are computed first, so under
LRU they would be evicted first), and a prompt larger than the whole cache claims nothing.

Workers are named by the index's slot bits, so ``owners`` ORs straight into its match.
No clock inside: callers pass ``now``. Single writer: the orchestrator's event loop.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from foundation.identity import BlockHash


@dataclass(frozen=True)
class PendingSettings:
    # No request waits longer than this for its first token (the service fails it first:
    # the worker timeout, or the queue-wait limit plus one timeout on a busy worker): a claim
    # still open then belongs to a request we lost track of.
    max_age_seconds: float = 660.0
    # KV events travel on their own socket and may reach the orchestrator after the first
    # token: two heartbeat intervals for them to land before the unconfirmed rest goes.
    settle_grace_seconds: float = 2.0

    def __post_init__(self):
        if self.max_age_seconds <= 0 or self.settle_grace_seconds < 0:
            raise ValueError("max_age_seconds must be > 0 and settle_grace_seconds >= 0")


@dataclass(eq=False)
class _Claim:
    bit: int
    request_id: str
    blocks: set[BlockHash]  # claimed and not yet confirmed
    deadline: float
    order: int  # claims on one worker are pushed out oldest first


ClaimKey = tuple[int, str]  # (worker slot bit, request id), for the deadline heap


@dataclass
class PendingBlocks:
    settings: PendingSettings = field(default_factory=PendingSettings)
    _claims: dict[int, dict[str, _Claim]] = field(default_factory=dict)  # bit → request → claim, oldest first
    _claimants: dict[tuple[BlockHash, int], set[str]] = field(default_factory=dict)  # (block, bit) → requests
    _owners: dict[BlockHash, int] = field(default_factory=dict)  # block → bitmask of claiming workers
    _claimed: dict[int, int] = field(default_factory=dict)  # bit → distinct blocks claimed there
    _deadlines: list[tuple[float, int, ClaimKey]] = field(default_factory=list)  # a heap; stale rows skipped
    _order: int = 0

    # ------------------------------------------------------------ reads

    def owners(self, block_hash: BlockHash) -> int:
        return self._owners.get(block_hash, 0)

    @property
    def owner_masks(self) -> Mapping[BlockHash, int]:
        """Block → bitmask of the workers claiming it; read-only, for the index's match loop."""
        return self._owners

    def num_claimed(self, bit: int) -> int:
        return self._claimed.get(bit, 0)

    def claimants(self, bit: int, block_hash: BlockHash) -> frozenset[str]:
        """The requests whose claims on worker ``bit`` still hold ``block_hash``."""
        return frozenset(self._claimants.get((block_hash, bit), ()))

    # ------------------------------------------------------------ writes

    def claim(self, bit: int, request_id: str, block_hashes: Sequence[BlockHash], capacity_blocks: int,
              now: float) -> None:
        self.release(bit, request_id)
        blocks = set(block_hashes)
        if not blocks or len(blocks) > capacity_blocks:
            return
        worker_claims = self._claims.setdefault(bit, {})
        while worker_claims and self.num_claimed(bit) + self._unclaimed(bit, blocks) > capacity_blocks:
            self._drop(next(iter(worker_claims.values())))  # the oldest
        claim = _Claim(bit, request_id, blocks, now + self.settings.max_age_seconds, self._order)
        self._order += 1
        worker_claims[request_id] = claim
        for block in blocks:
            self._add(block, bit, request_id)
        heapq.heappush(self._deadlines, (claim.deadline, claim.order, (bit, request_id)))

    def confirm(self, bit: int, block_hash: BlockHash) -> None:
        """The worker reported ``block_hash`` stored: the index holds it now, for every claimant."""
        for request_id in self._claimants.pop((block_hash, bit), ()):
            self._claims[bit][request_id].blocks.discard(block_hash)
        self._clear_owner(block_hash, bit)

    def settle(self, bit: int, request_id: str, now: float) -> None:
        """The request's prefill finished: what is still unconfirmed goes after the grace."""
        claim = self._find(bit, request_id)
        if claim is None:
            return
        deadline = now + self.settings.settle_grace_seconds
        if deadline < claim.deadline:
            claim.deadline = deadline
            heapq.heappush(self._deadlines, (deadline, claim.order, (bit, request_id)))

    def release(self, bit: int, request_id: str) -> None:
        claim = self._find(bit, request_id)
        if claim is not None:
            self._drop(claim)

    def drop_worker(self, bit: int) -> None:
        for claim in list(self._claims.get(bit, {}).values()):
            self._drop(claim)

    def expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, order, key = heapq.heappop(self._deadlines)
            claim = self._find(*key)
            if claim is not None and claim.order == order and claim.deadline == deadline:
                self._drop(claim)

    # ------------------------------------------------------------ internals

    def _find(self, bit: int, request_id: str) -> _Claim | None:
        return self._claims.get(bit, {}).get(request_id)

    def _unclaimed(self, bit: int, blocks: set[BlockHash]) -> int:
        return sum(1 for block in blocks if not self.owners(block) >> bit & 1)

    def _add(self, block: BlockHash, bit: int, request_id: str) -> None:
        claimants = self._claimants.setdefault((block, bit), set())
        if not claimants:
            self._owners[block] = self.owners(block) | (1 << bit)
            self._claimed[bit] = self.num_claimed(bit) + 1
        claimants.add(request_id)

    def _drop(self, claim: _Claim) -> None:
        del self._claims[claim.bit][claim.request_id]
        for block in claim.blocks:
            claimants = self._claimants[block, claim.bit]
            claimants.discard(claim.request_id)
            if not claimants:
                del self._claimants[block, claim.bit]
                self._clear_owner(block, claim.bit)

    def _clear_owner(self, block: BlockHash, bit: int) -> None:
        owners = self.owners(block)
        if not owners >> bit & 1:
            return
        self._claimed[bit] -= 1
        if owners & ~(1 << bit):
            self._owners[block] = owners & ~(1 << bit)
        else:
            del self._owners[block]
