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


@dataclass
class KVRouteConnectorMetadata(KVConnectorMetadata):
    grants: list[LeaseGrant] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    # Consumer: leases to give back without pulling (full local hit, abort, rejection).
    releases: list[tuple[PullSource, str]] = field(default_factory=list)
    # The step computes nothing: vLLM is only polling for finished transfers.
    idle_step: bool = False

    def is_empty(self) -> bool:
        return not (self.grants or self.loads or self.releases or self.idle_step)
