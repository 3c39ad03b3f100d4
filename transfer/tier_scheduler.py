"""The scheduler half's dealings with the node KV tier (``transfer.node_store``).

Per request without a pull source::

    get_num_new_matched_tokens ── TierLookup of the prompt's blocks beyond the local hit,
        on a thread of its own (``transfer.tier_lookups``): "not yet" until the store
        answers, then the leading blocks it holds, as external tokens
    update_state_after_alloc ──▶ TierLoad: those blocks, into the cache blocks vLLM allocated
        (the worker half reads them; a failed or refused read is a failed load: recomputed)
    update_connector_output ──▶ the load is done (``loaded``)
    request_finished ──▶ TierSave: the request's full blocks it computed itself (beyond its
        local hit, its tier load and any pull), written through at the next step; the
        tokens its load brought and the seconds from its first lookup to the load's end (what
        the tier took of its time to first token), in the output's kv_transfer_params
        ("tier_tokens", "tier_seconds")

What a request computed itself is what neither the engine nor the store held when it was
admitted, so the connector writes each block roughly once without asking the store first;
the store skips any it already holds. Blocks are named by kvroute's namespaced chain
hashes (``foundation.identity``): the hash covers the cache salt, so tenants never share.

Single writer: vLLM's scheduler thread calls every method. No I/O: lookups run on their
own thread, loads and saves in the worker half.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from foundation import identity
from foundation.lru import LruDict
from transfer.metadata import TierLoad, TierSave
from transfer.tier_lookups import REMEMBERED_LOOKUPS, Executor, LookupClient, TierLookups


@dataclass
class _Admitted:
    first_new_block: int  # blocks before it came from the engine's cache, the tier or a pull
    tier_tokens: int = 0
    local_blocks: int = 0  # where a failed tier load's recompute starts
    asked_at: float = 0.0  # its first lookup
    loaded_at: float | None = None  # when the worker half reported its load done


@dataclass(frozen=True)
class TierHit:
    """What the node store gave a finished request: prompt tokens, and the seconds from its
    first lookup to the end of their load (0 for none)."""

    tokens: int = 0
    seconds: float = 0.0


def block_keys(token_ids: list[int], block_size: int, cache_salt: str | None) -> list[bytes]:
    """The node store's names of the full blocks of ``token_ids``."""
    return [h.to_bytes(16, "little") for h in identity.block_hashes(token_ids, block_size, cache_salt)]


class TierScheduler:
    def __init__(self, client: LookupClient, block_size: int, executor: Executor | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """``executor``: where lookups run (default: a thread of their own)."""
        self.block_size = block_size
        self.clock = clock
        self._asked_at: LruDict[str, float] = LruDict(REMEMBERED_LOOKUPS)  # id → its first lookup
        self._lookups = TierLookups(client, executor)
        # id → blocks of its local hit, as vLLM last asked about it. (At allocation the blocks
        # tell no more: vLLM hashes the blocks a step will fill when it allocates them.)
        self._local_hits: LruDict[str, int] = LruDict(REMEMBERED_LOOKUPS)
        self._admitted: dict[str, _Admitted] = {}

    def note_local_hit(self, request: Any, num_computed_tokens: int) -> None:
        """vLLM asks for external tokens beyond ``num_computed_tokens`` (block-aligned) just
        before it allocates: that is the request's hit in the engine's own cache."""
        self._local_hits[request.request_id] = num_computed_tokens // self.block_size

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Prompt tokens the store holds beyond ``num_computed_tokens`` (block-aligned), in
        whole blocks, leaving the last prompt token to compute; None until the store answers."""
        loadable_blocks = (len(request.prompt_token_ids) - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        if loadable_blocks <= first:
            return 0
        keys = self._keys(request, request.prompt_token_ids)[first:loadable_blocks]
        self._asked_at.setdefault(request.request_id, self.clock())
        blocks = self._lookups.leading(request.request_id, first, keys)
        return None if blocks is None else min(blocks, len(keys)) * self.block_size

    def admitted(self, request: Any, num_external_tokens: int) -> None:
        """A request allocated without a tier load, whose ``num_external_tokens`` (if any)
        come from a pull; its first admission counts."""
        self._lookups.forget(request.request_id)
        self._asked_at.pop(request.request_id, None)
        local = self._local_hits.pop(request.request_id, 0)
        first_new = (local * self.block_size + num_external_tokens) // self.block_size
        self._admitted.setdefault(request.request_id, _Admitted(first_new, local_blocks=local))

    def plan_load(self, request: Any, group: list[Any], num_external_tokens: int) -> TierLoad:
        """The tier's blocks into vLLM's blocks after the local hit (``group``: all of the
        request's blocks)."""
        self._lookups.forget(request.request_id)
        num_local_blocks = self._local_hits.pop(request.request_id, 0)
        blocks = group[num_local_blocks:]
        count = num_external_tokens // self.block_size
        keys = self._keys(request, request.prompt_token_ids)[num_local_blocks:num_local_blocks + count]
        asked_at = self._asked_at.pop(request.request_id, None)
        self._admitted[request.request_id] = _Admitted(num_local_blocks + count, num_external_tokens,
                                                       num_local_blocks, asked_at or self.clock())
        return TierLoad(request.request_id, tuple(keys), tuple(b.block_id for b in blocks[:count]))

    def load_failed(self, request_id: str) -> None:
        """vLLM recomputes what the load should have brought: it is new, and counts as no tier hit."""
        admitted = self._admitted.get(request_id)
        if admitted is not None:
            admitted.first_new_block, admitted.tier_tokens = admitted.local_blocks, 0

    def loaded(self, request_ids: Iterable[str]) -> None:
        """The worker half finished these requests' loads (tier loads, or pulls: ignored)."""
        now = self.clock()
        for request_id in request_ids:
            admitted = self._admitted.get(request_id)
            if admitted is not None and admitted.tier_tokens and admitted.loaded_at is None:
                admitted.loaded_at = now

    def finished(self, request: Any, block_ids: list[int]) -> tuple[TierSave | None, TierHit]:
        """(the blocks to write through, what its tier load brought)."""
        self._lookups.forget(request.request_id)
        self._local_hits.pop(request.request_id, None)
        self._asked_at.pop(request.request_id, None)
        admitted = self._admitted.pop(request.request_id, None)
        first = admitted.first_new_block if admitted is not None else 0
        hit = _hit(admitted)
        computed = list(getattr(request, "all_token_ids", request.prompt_token_ids))[:request.num_computed_tokens]
        keys = self._keys(request, computed)[first:len(block_ids)]
        if not keys:
            return None, hit
        return TierSave(request.request_id, tuple(keys), tuple(block_ids[first:first + len(keys)])), hit

    def _keys(self, request: Any, token_ids: list[int]) -> list[bytes]:
        return block_keys(list(token_ids), self.block_size, getattr(request, "cache_salt", None))


def _hit(admitted: _Admitted | None) -> TierHit:
    if admitted is None or not admitted.tier_tokens:
        return TierHit()
    seconds = admitted.loaded_at - admitted.asked_at if admitted.loaded_at is not None else 0.0
    return TierHit(admitted.tier_tokens, max(0.0, seconds))
