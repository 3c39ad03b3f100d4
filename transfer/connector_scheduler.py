"""The scheduler half of the kvroute connector (runs in vLLM's engine-core process).

Per request, ``kv_transfer_params["kvroute"]`` says what to do:

* producer: ``{"hold_blocks": true}`` — when the prefill finishes, keep its blocks
  under a fresh lease and return a ``PullSource`` in the request's output;
* consumer: ``{"pull_from": PullSource}`` — report the prompt tokens the producer
  holds beyond the local prefix cache as external, and pull only those blocks.

Pulled blocks are first to evict (``ConnectorSettings.evict_pulled_first``): when a
consumer's request ends, the prompt blocks it pulled go in front of every other cached
block in vLLM's free queue (``transfer.free_queue``) instead of behind them, so the
consumer's cache spends its room on what only it holds (prompts it prefilled itself)
rather than on copies the producer most likely still has. A pulled block that another
request is using by then keeps vLLM's order.

With a node store (``ConnectorSettings.node_store``), a request without a pull source
looks for its prompt's blocks there, and every request's newly computed blocks are
written through to it (``transfer.tier_scheduler``).

Everything here is bookkeeping; all I/O but the node store's lookup happens in the
worker half.
"""

from __future__ import annotations

import logging
import math
import secrets
from typing import Any

from foundation import wire
from transfer.free_queue import demote
from transfer.metadata import KVRouteConnectorMetadata, LeaseGrant, LoadSpec
from transfer.node_store.client import NodeStoreClient
from transfer.request_params import PARAMS_KEY, kvroute_params, prompt_digest
from transfer.settings import ConnectorSettings
from transfer.tier_scheduler import TierHit, TierScheduler

logger = logging.getLogger("kvroute.transfer.scheduler")

HANDLE_BYTES = 16  # 128 random bits: a handle is the only credential for tenant data
MAX_PENDING_DEMOTIONS = 4096  # ended requests whose pulled blocks wait to be demoted; older ones are dropped


class ConnectorScheduler:
    """Single writer: vLLM's scheduler thread calls every method."""

    def __init__(self, settings: ConnectorSettings, block_size: int, tier: TierScheduler | None = None):
        """``tier``: the dealings with ``settings.node_store`` (default: made here)."""
        self.settings = settings
        self.block_size = block_size
        self._pending = KVRouteConnectorMetadata()
        self._allocated: set[str] = set()  # consumer requests whose pull is planned
        self._pulled: dict[str, list[Any]] = {}  # consumer request → the vLLM blocks its pull fills
        self._finished_pulls: list[list[tuple[Any, Any]]] = []  # (block, its hash) of ended requests, to demote
        self._demotion_waits = False  # the last scan met a long never-cached run; no rescans until the step ends
        if tier is None and settings.node_store:
            client = NodeStoreClient(settings.node_store, lookup_timeout=settings.node_store_lookup_seconds)
            tier = TierScheduler(client, block_size)
        self._tier = tier

    # ---------------------------------------------------------------- consumer

    def pull_source(self, request: Any) -> wire.PullSource | None:
        raw = kvroute_params(request).get("pull_from")
        if raw is None:
            return None
        try:
            return wire.from_dict(raw, wire.PullSource)
        except wire.WireError:
            logger.warning("request %s: malformed pull_from, computing locally", request.request_id)
            return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The producer's tokens beyond the local prefix hit; free of side effects on the
        request. vLLM asks this of a new request before it allocates the request's blocks,
        so ended requests' pulled blocks are demoted here first (an idle engine takes no
        step between the last request's end and the next one's allocation)."""
        if not self._demotion_waits:  # else the queue was scanned in vain this step: retried at its end
            self._demote_finished_pulls()
        if self._tier is not None:
            self._tier.note_local_hit(request, num_computed_tokens)
        source = self.pull_source(request)
        if source is None:
            count = self._tier.matched_tokens(request, num_computed_tokens) if self._tier is not None else 0
            if count is None:
                return None, False  # the store's answer is on the way: vLLM asks again next step
            return (count, True) if count > 0 else (0, False)
        if request.request_id in self._allocated:
            return 0, False
        if not self._prefix_matches(request, source):
            return 0, False
        # The last prompt token is always computed here, so its logits exist.
        loadable = min(source.num_tokens, len(request.prompt_token_ids) - 1)
        count = loadable - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _prefix_matches(self, request: Any, source: wire.PullSource) -> bool:
        prefix = list(request.prompt_token_ids[: source.num_tokens])
        ok = len(prefix) == source.num_tokens and prompt_digest(
            prefix, getattr(request, "cache_salt", None)) == source.prompt_digest
        if not ok:
            logger.warning("request %s: prompt or namespace differs from the producer's; not pulling",
                           request.request_id)
        return ok

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        source = self.pull_source(request)
        if source is None:
            self._admit_for_tier(request, blocks, num_external_tokens)
            return
        if request.request_id in self._allocated:
            return
        self._allocated.add(request.request_id)
        if num_external_tokens == 0:
            self._tier_admitted(request, 0)
            self._pending.releases.append((source, "local_hit"))
            return
        self._pending.loads.append(self._plan_load(request, source, blocks, num_external_tokens))

    def _plan_load(self, request: Any, source: wire.PullSource, blocks: Any, num_external_tokens: int) -> LoadSpec:
        group = blocks.blocks[0]
        num_local_blocks = _num_cached(group)
        num_tokens = num_local_blocks * self.block_size + num_external_tokens
        last = math.ceil(num_tokens / self.block_size)
        pulled = group[num_local_blocks:last]
        if self.settings.evict_pulled_first:
            self._pulled[request.request_id] = list(pulled)
        self._tier_admitted(request, num_external_tokens)
        local_ids = tuple(block.block_id for block in pulled)
        return LoadSpec(request.request_id, source, tuple(range(num_local_blocks, last)), local_ids)

    # ---------------------------------------------------------------- node KV tier

    def _admit_for_tier(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """A request without a pull source: load what its lookup found in the tier."""
        if self._tier is None:
            return
        if num_external_tokens == 0:
            self._tier.admitted(request, 0)
            return
        self._pending.tier_loads.append(self._tier.plan_load(request, blocks.blocks[0], num_external_tokens))

    def _tier_admitted(self, request: Any, num_external_tokens: int) -> None:
        """Its blocks up to its local hit and external tokens are not written through: the
        engine had them, or the producer that computed them (full blocks only)."""
        if self._tier is not None:
            self._tier.admitted(request, num_external_tokens)

    def loads_failed(self, request_ids: set[str]) -> None:
        """vLLM recomputes these requests' external tokens (``kv_load_failure_policy``)."""
        if self._tier is not None:
            for request_id in request_ids:
                self._tier.load_failed(request_id)

    # ---------------------------------------------------------------- producer

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Hold a producer's blocks under a lease; write new blocks through to the node store.
        The output's ``kv_transfer_params["kvroute"]`` carry the pull source, and the prompt
        tokens loaded from the node store with the seconds that took (``tier_tokens``,
        ``tier_seconds``)."""
        held, params = self._hold(request, block_ids)
        hit = self._write_through(request, block_ids)
        if hit.tokens:
            params = params or {PARAMS_KEY: {}}
            params[PARAMS_KEY].update(tier_tokens=hit.tokens, tier_seconds=round(hit.seconds, 6))
        return held, params

    def loads_done(self, request_ids: set[str]) -> None:
        """The worker half finished loading these requests' external tokens."""
        if self._tier is not None:
            self._tier.loaded(request_ids)

    def _write_through(self, request: Any, block_ids: list[int]) -> TierHit:
        """Plans the write-through of the request's new blocks; what its tier load brought."""
        if self._tier is None:
            return TierHit()
        save, hit = self._tier.finished(request, block_ids)
        if save is not None:
            self._pending.tier_saves.append(save)
        return hit

    def _hold(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = kvroute_params(request)
        request_id = request.request_id
        if request_id in self._allocated:
            self._allocated.discard(request_id)
            if (pulled := self._pulled.pop(request_id, None)) is not None:
                self._note_finished_pull(pulled, block_ids)
        elif (source := self.pull_source(request)) is not None:
            # Finished (aborted or rejected) before a pull was planned: give the lease back.
            self._pending.releases.append((source, "abort"))
        if not params.get("hold_blocks") or not block_ids or not _finished_normally(request):
            return False, None
        return True, {PARAMS_KEY: {"pull_source": wire.to_dict(self._grant(request, block_ids))}}

    def _grant(self, request: Any, block_ids: list[int]) -> wire.PullSource:
        handle = secrets.token_hex(HANDLE_BYTES)
        num_tokens = request.num_computed_tokens
        self._pending.grants.append(LeaseGrant(request.request_id, handle, tuple(block_ids), num_tokens))
        digest = prompt_digest(list(request.prompt_token_ids[:num_tokens]), getattr(request, "cache_salt", None))
        return wire.PullSource(handle=handle, address=self.settings.transfer_address,
                               num_tokens=num_tokens, block_size=self.block_size, prompt_digest=digest)

    # ---------------------------------------------------------------- per step

    def build_connector_meta(self, num_scheduled_tokens: int = 1) -> KVRouteConnectorMetadata:
        self._demotion_waits = False
        self._demote_finished_pulls()
        metadata, self._pending = self._pending, KVRouteConnectorMetadata()
        metadata.idle_step = num_scheduled_tokens == 0
        return metadata

    def _note_finished_pull(self, pulled: list[Any], block_ids: list[int]) -> None:
        """vLLM frees the request's blocks right after ``request_finished``; remember which
        pulled ones it still holds (a preempted request was given new blocks) and what
        they hold."""
        held = set(block_ids)
        blocks = [(b, b.block_hash) for b in pulled if b.block_id in held and b.block_hash is not None]
        if blocks:
            self._finished_pulls.append(blocks)
            del self._finished_pulls[:-MAX_PENDING_DEMOTIONS]

    def _demote_finished_pulls(self) -> None:
        """Put the ended requests' pulled blocks first among the free cached blocks: older
        requests first, each tail first (a chain's head outlives its tail, as in vLLM's own
        order). Runs once vLLM has freed them: before the next request's allocation, or at the
        next step. A block some request uses
        again by then, or that no longer holds what was pulled into it, is left alone. While
        a long run of never-cached free blocks leads the queue nothing cached is evicted;
        the blocks wait for a later step."""
        if not self._finished_pulls:
            return
        self._finished_pulls = [idle for pulled in self._finished_pulls
                                if (idle := [(b, held) for b, held in pulled
                                             if b.ref_cnt == 0 and b.block_hash == held])]
        blocks = [b for pulled in self._finished_pulls for b, _ in reversed(pulled)]
        pool = getattr(blocks[0], "pool", None) if blocks else None
        if pool is None or demote(pool.free_block_queue, blocks):
            self._finished_pulls = []
        else:
            self._demotion_waits = True


def _num_cached(group: list[Any]) -> int:
    """The leading blocks of a request's allocation that the engine's prefix cache supplied."""
    return sum(1 for block in group if block.block_hash is not None)


def _finished_normally(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
