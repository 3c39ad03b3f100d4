"""Connector settings, read once from vLLM's ``kv_connector_extra_config``."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from transfer.link_control import transport_settings
from transfer.link_names import (
    DEFAULT_TRANSFER_CHECKSUM,
    ENDPOINT,
    check_transfer_link,
    parse_link_hosts,
    transfer_checksum_on,
)
from transfer.node_store.settings import check_loopback_or_ipc
from transfer.transports.selection import HOSTED_AT_ONCE
from transfer.transports.settings import AUTO, TransportSettings


@dataclass(frozen=True)
class ConnectorSettings:
    """Defaults are the documented ones (README, "Transfer settings")."""

    # Where this engine's transfer endpoint binds, and the address peers use to reach it.
    transfer_bind: str = "tcp://127.0.0.1:0"
    transfer_address: str = ""
    # A producer frees leased blocks after this long even if no consumer pulled them.
    lease_seconds: float = 30.0
    # A consumer gives up a pull after this long and recomputes the prompt instead.
    pull_timeout_seconds: float = 10.0
    # A pull that races ahead of its lease grant waits this long for it.
    park_seconds: float = 5.0
    # At most this many pulls wait for their grants at once; more are refused at once (the
    # consumer recomputes), so pulls naming handles that never come cost bounded memory and time.
    max_parked_pulls: int = 64
    # Host memory a producer may use to copy leased blocks out of the engine's cache, so the
    # engine frees them at once instead of stepping until the lease ends; 0 keeps every
    # lease in place.
    staging_bytes: int = 1 << 30
    # How long vLLM's model worker busy-waits for its next command after each one (vLLM's own:
    # 1 s; see transfer.idle_spin); negative leaves vLLM's.
    idle_spin_seconds: float = 0.02
    # CPUs of the transfer threads and their ZeroMQ I/O thread, e.g. "2-3"; empty: every CPU
    # (see transfer.affinity).
    transfer_cpus: str = ""
    # How pulled layers travel: "endpoint" (back on the connection that asked, the default)
    # or over a transport link per producer–consumer pair (transfer.link_control): "auto"
    # (CUDA caches: nccl; one host: zmq-ipc; else zmq-tcp; measured against nixl at the link's
    # set-up where both ends run it, the faster kept) or a backend name forcing it.
    transfer_link: str = "endpoint"
    # The backends this endpoint hosts links of when a consumer asks, comma-separated; empty:
    # what transfer_link implies ("endpoint": zmq-ipc and zmq-tcp, which cost no wait; "auto":
    # what auto picks or measures; a backend: it and the ZeroMQ ones). Gloo and NCCL make the endpoint wait
    # for the peer to join, so it hosts them only when configured for them.
    transfer_link_hosts: str = ""
    # Stage leases in shared memory, and read a producer's staged copy straight into this
    # cache when both ends run on one host (transfer.shared_copies); off: always frames.
    shared_copies: bool = True
    # A consumer's pulled prompt blocks go first when its cache must evict (see
    # transfer.connector_scheduler); off: vLLM's plain LRU order.
    evict_pulled_first: bool = True
    # How the transfer endpoint and links speak (foundation.zmq_auth): the cluster's key
    # folder, or in clear when ``insecure_no_auth``; ``transfer_encryption`` off: KV bytes
    # in clear under keys.
    cluster_keys: str = ""
    insecure_no_auth: bool = False
    transfer_encryption: bool = True
    # A consumer asks for an xxh3 digest of every pulled frame and checks it before the
    # frame reaches its cache (transfer.transports.checksums); a mismatch fails the pull,
    # and the request is recomputed.
    transfer_checksum: bool = transfer_checksum_on(DEFAULT_TRANSFER_CHECKSUM)
    # The node KV store of this host (transfer.node_store), e.g. tcp://127.0.0.1:7390: new
    # blocks are written through to it and prompts load the leading blocks it holds; empty: none.
    node_store: str = ""
    # How long a request may wait for the store's answer to its lookup before its prompt is
    # computed instead (other requests go on meanwhile: transfer.tier_lookups); a store that
    # missed it is left alone for a few seconds.
    node_store_lookup_seconds: float = 0.5

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = {f.name for f in fields(cls)}
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown kvroute connector settings: {sorted(unknown)}")
        settings = cls(**extra)
        if not settings.transfer_address:
            raise ValueError("kvroute connector needs transfer_address (the advertised endpoint)")
        check_transfer_link(settings.transfer_link)
        parse_link_hosts(settings.transfer_link_hosts)
        if settings.node_store:
            check_loopback_or_ipc(settings.node_store)
        if settings.node_store_lookup_seconds <= 0:
            raise ValueError("node_store_lookup_seconds must be positive")
        if settings.max_parked_pulls < 1:
            raise ValueError("max_parked_pulls must be at least 1")
        return settings

    @property
    def uses_links(self) -> bool:
        return self.transfer_link != ENDPOINT

    def link_settings(self) -> TransportSettings:
        """This end's side of transport links: its override, if any, its host, and the
        backends its endpoint hosts for consumers that ask."""
        settings = transport_settings(self.transfer_link if self.uses_links else AUTO, self.transfer_address)
        hosted = parse_link_hosts(self.transfer_link_hosts)
        if hosted is None and not self.uses_links:
            hosted = HOSTED_AT_ONCE
        return replace(settings, hosted=hosted)
