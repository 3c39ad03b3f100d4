"""What the scheduler half of the connector tells the worker half, once per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from foundation.wire import PullSource


@dataclass(frozen=True)
class LeaseGrant:
    """Producer: hold these blocks of a finished request under ``handle``."""

    request_id: str
    handle: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class LoadSpec:
    """Consumer: pull lease positions ``remote_indices`` into ``local_block_ids``."""

    request_id: str
    source: PullSource
    remote_indices: tuple[int, ...]
    local_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class TierLoad:
    """Read these node store blocks (``transfer.node_store``) into ``local_block_ids``."""

    request_id: str
    keys: tuple[bytes, ...]
    local_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class TierSave:
    """Write these blocks of a finished request through to the node store."""

    request_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass
class KVRouteConnectorMetadata(KVConnectorMetadata):
    grants: list[LeaseGrant] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    # Consumer: leases to give back without pulling (full local hit, abort, rejection).
    releases: list[tuple[PullSource, str]] = field(default_factory=list)
    # The step computes nothing: vLLM is only polling for finished transfers.
    idle_step: bool = False
    tier_loads: list[TierLoad] = field(default_factory=list)
    tier_saves: list[TierSave] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.grants or self.loads or self.releases or self.idle_step or self.tier_loads
                    or self.tier_saves)
