"""The scheduler half of the kvroute connector (runs in vLLM's engine-core process).

Per request, ``kv_transfer_params["kvroute"]`` says what to do:

* producer: ``{"hold_blocks": true}`` — when the prefill finishes, keep its blocks
  under a fresh lease and return a ``PullSource`` in the request's output;
* consumer: ``{"pull_from": PullSource}`` — report the prompt tokens the producer
  holds beyond the local prefix cache as external, and pull only those blocks.

Everything here is bookkeeping; all I/O happens in the worker half.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
from typing import Any

from kvroute import wire
from transfer.metadata import KVRouteConnectorMetadata, LeaseGrant, LoadSpec
from transfer.settings import ConnectorSettings

logger = logging.getLogger("kvroute.transfer.scheduler")

PARAMS_KEY = "kvroute"
HANDLE_BYTES = 16  # 128 random bits: a handle is the only credential for tenant data


def prompt_digest(token_ids: list[int], cache_salt: str | None) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update((cache_salt or "").encode())
    digest.update(b"\x00")
    digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return digest.hexdigest()


def kvroute_params(request: Any) -> dict:
    params = getattr(request, "kv_transfer_params", None) or {}
    return params.get(PARAMS_KEY) or {}


class ConnectorScheduler:
    """Single writer: vLLM's scheduler thread calls every method."""

    def __init__(self, settings: ConnectorSettings, block_size: int):
        self.settings = settings
        self.block_size = block_size
        self._pending = KVRouteConnectorMetadata()
        self._allocated: set[str] = set()  # consumer requests whose pull is planned

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

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Side-effect free: the producer's tokens beyond the local prefix hit."""
        source = self.pull_source(request)
        if source is None or request.request_id in self._allocated:
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
        if source is None or request.request_id in self._allocated:
            return
        self._allocated.add(request.request_id)
        if num_external_tokens == 0:
            self._pending.releases.append((source, "local_hit"))
            return
        self._pending.loads.append(self._plan_load(request.request_id, source, blocks, num_external_tokens))

    def _plan_load(self, request_id: str, source: wire.PullSource, blocks: Any,
                   num_external_tokens: int) -> LoadSpec:
        group = blocks.blocks[0]
        num_local_blocks = sum(1 for block in group if block.block_hash is not None)
        num_tokens = num_local_blocks * self.block_size + num_external_tokens
        last = math.ceil(num_tokens / self.block_size)
        local_ids = tuple(block.block_id for block in group[num_local_blocks:last])
        return LoadSpec(request_id, source, tuple(range(num_local_blocks, last)), local_ids)

    # ---------------------------------------------------------------- producer

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = kvroute_params(request)
        request_id = request.request_id
        if request_id in self._allocated:
            self._allocated.discard(request_id)
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
        metadata, self._pending = self._pending, KVRouteConnectorMetadata()
        metadata.idle_step = num_scheduled_tokens == 0
        return metadata


def _finished_normally(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
