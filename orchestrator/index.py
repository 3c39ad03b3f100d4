"""Which worker holds how many leading blocks of a prompt. Mechanism only: it never decides.

Entries are keyed by kvroute's own chained block hashes (``foundation.identity``). vLLM's
events name blocks by the engine's hashes, so each worker keeps a map engine hash →
our hash; a stored block's hash is derived from its parent's (or, for a first block,
from the cache salt in its extra keys) and its tokens. A worker's entries live under
its incarnation id; a new incarnation or a dead worker purges them all.

Owners of a block are a bitmask over worker slots, so longest-prefix match walks the
prompt's block hashes once with one integer AND per block: O(prompt blocks).

Besides what the engines reported stored, a worker holds the blocks claimed for the
requests just routed to it (``pending_blocks``): a match counts both, so requests that
share a prefix follow the first of them even before its prefill ends. Claims go with
the worker's entries (purge, new incarnation, snapshot reload, cache cleared).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from foundation import identity, kv_events
from orchestrator.pending_blocks import PendingBlocks, PendingSettings


@dataclass
class _WorkerEntries:
    incarnation: str
    bit: int
    ours: dict[kv_events.EngineHash, identity.BlockHash] = field(default_factory=dict)
    orphans: int = 0  # stored blocks whose parent we never saw (skipped, counted)


class PrefixIndex:
    """Single writer of stored blocks: the index-sync task of the orchestrator; of claims:
    the completion service, as it routes requests and sees them prefilled."""

    def __init__(self, pending: PendingSettings | None = None):
        self._owners: dict[identity.BlockHash, int] = {}  # block → bitmask of worker slots
        self._workers: dict[str, _WorkerEntries] = {}
        self._slot_owner: dict[int, str] = {}  # bit → worker id
        # Blocks each worker's engine evicted (BlockRemoved), since this orchestrator started;
        # kept across resyncs and restarts so it only ever grows, until the worker leaves.
        self._evicted: dict[str, int] = {}
        self._pending = PendingBlocks(pending or PendingSettings())

    # ------------------------------------------------------------ writes

    def reset_worker(self, worker_id: str, incarnation: str) -> None:
        """Forget everything about ``worker_id`` and start its entries afresh."""
        self.purge(worker_id)
        bit = next(b for b in range(len(self._slot_owner) + 1) if b not in self._slot_owner)
        self._slot_owner[bit] = worker_id
        self._workers[worker_id] = _WorkerEntries(incarnation, bit)

    def purge(self, worker_id: str) -> None:
        entries = self._workers.pop(worker_id, None)
        if entries is None:
            return
        for ours in entries.ours.values():
            self._disown(ours, entries.bit)
        self._pending.drop_worker(entries.bit)
        del self._slot_owner[entries.bit]

    def forget(self, worker_id: str) -> None:
        """``purge``, and the worker's eviction count too: it left the fleet."""
        self.purge(worker_id)
        self._evicted.pop(worker_id, None)

    def apply(self, worker_id: str, event: kv_events.KVEvent) -> None:
        entries = self._workers[worker_id]
        if isinstance(event, kv_events.BlockStored):
            for record in kv_events.stored_blocks(event):
                self._store(worker_id, entries, record, event.lora_name)
        elif isinstance(event, kv_events.BlockRemoved):
            self._evicted[worker_id] = self._evicted.get(worker_id, 0) + len(event.block_hashes)
            for engine_hash in event.block_hashes:
                ours = entries.ours.pop(engine_hash, None)
                if ours is not None:
                    self._disown(ours, entries.bit)
        else:
            self.reset_worker(worker_id, entries.incarnation)

    def load_snapshot(self, worker_id: str, incarnation: str, blocks: Iterable[kv_events.StoredBlockRecord]) -> None:
        """Replace a worker's entries with a snapshot; parents may come after children."""
        self.reset_worker(worker_id, incarnation)
        entries = self._workers[worker_id]
        pending = list(blocks)
        while pending:
            progress = [r for r in pending if r.parent is None or r.parent in entries.ours]
            if not progress:
                entries.orphans += len(pending)
                return
            for record in progress:
                self._store(worker_id, entries, record, None)
            done = {id(r) for r in progress}
            pending = [r for r in pending if id(r) not in done]

    def _store(self, worker_id: str, entries: _WorkerEntries, record: kv_events.StoredBlockRecord,
               lora_name: str | None) -> None:
        if record.parent is None:
            parent = identity.chain_seed(kv_events.salt_of(record.extra_keys, lora_name))
        elif record.parent in entries.ours:
            parent = entries.ours[record.parent]
        else:
            entries.orphans += 1  # unreachable by prefix match anyway
            return
        ours = identity.next_block_hash(parent, record.token_ids)
        entries.ours[record.engine_hash] = ours
        self._owners[ours] = self._owners.get(ours, 0) | (1 << entries.bit)
        self._pending.confirm(entries.bit, ours)

    def _disown(self, ours: identity.BlockHash, bit: int) -> None:
        owners = self._owners.get(ours, 0) & ~(1 << bit)
        if owners:
            self._owners[ours] = owners
        else:
            self._owners.pop(ours, None)

    # ------------------------------------------------------------ claims

    def claim(self, worker_id: str, request_id: str, block_hashes: list[identity.BlockHash],
              capacity_blocks: int, now: float) -> None:
        """``request_id`` was routed to ``worker_id``, which will compute and cache its
        prompt's ``block_hashes``; ``capacity_blocks``: the worker's KV cache."""
        entries = self._workers.get(worker_id)
        if entries is not None:  # a worker the index does not follow gets no claims either
            self._pending.claim(entries.bit, request_id, block_hashes, capacity_blocks, now)

    def settle(self, worker_id: str, request_id: str, now: float) -> None:
        """The request's prefill on ``worker_id`` is done (its first token came)."""
        entries = self._workers.get(worker_id)
        if entries is not None:
            self._pending.settle(entries.bit, request_id, now)

    def release(self, worker_id: str, request_id: str) -> None:
        """The request left ``worker_id`` without a first token: its claim is void."""
        entries = self._workers.get(worker_id)
        if entries is not None:
            self._pending.release(entries.bit, request_id)

    def expire_claims(self, now: float) -> None:
        self._pending.expire(now)

    # ------------------------------------------------------------ reads

    def incarnation(self, worker_id: str) -> str | None:
        entries = self._workers.get(worker_id)
        return entries.incarnation if entries else None

    def num_blocks(self, worker_id: str) -> int:
        entries = self._workers.get(worker_id)
        return len(entries.ours) if entries else 0

    def num_claimed(self, worker_id: str) -> int:
        """Distinct blocks claimed on the worker for requests routed there."""
        entries = self._workers.get(worker_id)
        return self._pending.num_claimed(entries.bit) if entries else 0

    def claimants(self, worker_id: str, block_hash: identity.BlockHash) -> frozenset[str]:
        """The requests routed to ``worker_id`` whose claims still hold ``block_hash``
        (it is not reported stored there yet)."""
        entries = self._workers.get(worker_id)
        return self._pending.claimants(entries.bit, block_hash) if entries else frozenset()

    def num_evicted(self, worker_id: str) -> int:
        """Blocks the worker's engine reported evicted while this index followed it."""
        return self._evicted.get(worker_id, 0)

    def match(self, block_hashes: list[identity.BlockHash]) -> dict[str, int]:
        """Per worker with at least one match: how many leading blocks it holds, stored or claimed."""
        matched: dict[str, int] = {}
        active = 0
        claimed = self._pending.owner_masks  # one lookup per block, as for stored owners
        for position, block_hash in enumerate(block_hashes):
            owners = self._owners.get(block_hash, 0) | claimed.get(block_hash, 0)
            still = owners if position == 0 else active & owners
            self._record(active & ~still, position, matched)
            active = still
            if not active:
                return matched
        self._record(active, len(block_hashes), matched)
        return matched

    def stored_prefix(self, worker_id: str, block_hashes: list[identity.BlockHash]) -> int:
        """How many leading blocks the worker's engine reported stored (claims not counted)."""
        entries = self._workers.get(worker_id)
        if entries is None:
            return 0
        mask = 1 << entries.bit
        for position, block_hash in enumerate(block_hashes):
            if not self._owners.get(block_hash, 0) & mask:
                return position
        return len(block_hashes)

    def _record(self, bits: int, length: int, matched: dict[str, int]) -> None:
        while bits:
            lowest = bits & -bits
            matched[self._slot_owner[lowest.bit_length() - 1]] = length
            bits ^= lowest
