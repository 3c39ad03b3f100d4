"""Settings of one worker process: typed, validated, frozen."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field, replace

from foundation import tracing
from foundation.addresses import check_host
from foundation.heartbeat_checks import check_name
from foundation.netutil import free_port, tcp
from foundation.wire import ROLES
from transfer.affinity import parse_cpus
from transfer.link_names import (
    DEFAULT_TRANSFER_CHECKSUM,
    ENDPOINT,
    check_transfer_link,
    parse_link_hosts,
    transfer_checksum_on,
)
from transfer.node_store.settings import check_loopback_or_ipc
from worker.orchestrator_targets import DEFAULT_RESOLVE_SECONDS, parse_entry
from worker.prompt_priority import FCFS, check_scheduling

DECODE_LONG_PREFILL_TOKENS = 256
PREFILL_LONG_PREFILL_TOKENS = 256
# A unified engine runs as one plain vLLM server would: no cap. Measured on 2 cores (bf16, a
# repository-assistant replay at 1 request/s, beside one plain vLLM server): capped at 256,
# its TTFT P50 was 3.56 s against vLLM's 2.00 s, as every 2-3k-token prompt took 10+ steps;
# uncapped, 2.12 s against 2.45 s.
UNIFIED_LONG_PREFILL_TOKENS = 0


def check_decode_guard(decoding_step_tokens: int, decoding_tpot_target: float) -> None:
    """The two ways of capping a step while requests decode (worker.decode_guard): one at most."""
    if decoding_step_tokens < 0:
        raise ValueError("decoding_step_tokens must be 0 (no cap) or positive")
    if decoding_tpot_target < 0:
        raise ValueError("decoding_tpot_target must be 0 (none) or positive seconds")
    if decoding_step_tokens and decoding_tpot_target:
        raise ValueError("give decoding_step_tokens or decoding_tpot_target, not both")


def default_long_prefill_tokens(role: str) -> int:
    """The per-request step cap a worker of ``role`` gives its engine unless told otherwise
    (see ``WorkerSettings.long_prefill_step_tokens``)."""
    return {"prefill": PREFILL_LONG_PREFILL_TOKENS, "unified": UNIFIED_LONG_PREFILL_TOKENS}.get(
        role, DECODE_LONG_PREFILL_TOKENS)


@dataclass(frozen=True)
class WorkerSettings:
    role: str
    model: str
    worker_id: str = ""
    dtype: str = "auto"  # see worker.dtype
    kv_cache_gib: float = 0.5  # 8192 tokens of SmolLM2 in float32
    block_size: int | None = None  # None: 32 on CPU, the engine's default on GPU (worker.block_size)
    max_model_len: int = 8192
    host: str = "127.0.0.1"  # address other processes use to reach this worker
    bind_host: str = "127.0.0.1"
    rpc_port: int = 0  # 0: pick a free port at start
    kv_events_port: int = 0
    transfer_port: int = 0
    # Registration/heartbeat endpoints to report to: tcp://HOST:PORT, or dns://NAME:PORT for
    # every address NAME has, looked up every orchestrator_resolve_seconds (worker.orchestrator_targets).
    orchestrators: tuple[str, ...] = ()
    orchestrator_resolve_seconds: float = DEFAULT_RESOLVE_SECONDS
    heartbeat_seconds: float = 1.0
    # Written after every heartbeat round for probes outside the process (worker.status_file); "": none.
    status_file: str = ""
    lease_seconds: float = 30.0
    lease_staging_gib: float = 1.0  # host copies of leased blocks; 0: hold them in the engine
    pull_timeout_seconds: float = 10.0
    # SIGTERM drains the worker (worker.drain): the longest it then waits for its
    # requests and leases to end before it stops anyway.
    drain_seconds: float = 30.0
    enforce_eager: bool = True
    seed: int = 0
    # Most prompt tokens one request may compute per engine step while others wait; None:
    # the role's default (see ``long_prefill_step_tokens``), 0: no cap.
    long_prefill_tokens: int | None = None
    # Most prompt tokens one engine step computes over all requests; None: vLLM's default
    # (2,048). Smaller steps bound how long every running request waits for its next token.
    step_tokens: int | None = None
    # While requests decode, an engine step computes only the prompt tokens that keep each
    # stream at its TPOT target, the request's own or else ``decoding_tpot_target`` (0: none);
    # or at most ``decoding_step_tokens`` of them, a fixed cap (0: none) (worker.decode_guard).
    decoding_step_tokens: int = 0
    decoding_tpot_target: float = 0.0
    # Which waiting prompt the engine computes first: vLLM's arrival order, or the shortest
    # expected prefill (worker.prompt_priority).
    scheduling: str = FCFS
    # Tokens of the timed prefill at start-up that calibrates orchestrators' cost models
    # (worker.prefill_probe); 0: none.
    probe_tokens: int = 128
    omp_threads_bind: str | None = None
    transfer_cpus: str = ""  # CPUs of the connector's transfer threads; empty: all (transfer.affinity)
    transfer_link: str = ENDPOINT  # how pulled KV travels (transfer.link_control)
    # The link backends its transfer endpoint hosts for consumers, comma-separated; empty: what
    # transfer_link implies (transfer.settings.ConnectorSettings.transfer_link_hosts).
    transfer_link_hosts: str = ""
    # Leases staged in shared memory, read in place by consumers on this host (transfer.shared_copies).
    shared_copies: bool = True
    # A decode worker's pulled prompt blocks go first when its cache must evict (transfer.connector_scheduler).
    evict_pulled_first: bool = True
    # A decode worker checks an xxh3 digest of every pulled frame before it stores it (transfer.pull_check).
    transfer_checksum: bool = transfer_checksum_on(DEFAULT_TRANSFER_CHECKSUM)
    # The node KV store of this host (transfer.node_store); empty: none.
    node_store: str = ""
    # Who may speak to this worker (foundation.zmq_auth): the cluster's key folder, or no
    # one checked at all with ``insecure_no_auth``; ``transfer_encryption`` off: KV bytes
    # travel in clear (trusted fabrics only).
    cluster_keys: str = ""
    insecure_no_auth: bool = False
    transfer_encryption: bool = True
    # Where its spans go (foundation.tracing): an OTLP collector's URL; empty: no tracing.
    otlp_endpoint: str = ""
    otlp_protocol: str = "http"
    # The private ipc:// socket the engine publishes KV events on (set by the worker at
    # start; see worker.event_relay).
    kv_events_local_address: str = ""
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be positive")
        if self.long_prefill_tokens is not None and self.long_prefill_tokens < 0:
            raise ValueError("long_prefill_tokens must not be negative")
        if self.step_tokens is not None and self.step_tokens < 1:
            raise ValueError("step_tokens must be positive")
        check_decode_guard(self.decoding_step_tokens, self.decoding_tpot_target)
        check_scheduling(self.scheduling)
        if not 0 <= self.probe_tokens < self.max_model_len:
            raise ValueError(f"probe_tokens must be in 0..{self.max_model_len - 1} (below max_model_len)")
        if self.lease_staging_gib < 0:
            raise ValueError("lease_staging_gib must not be negative")
        if self.drain_seconds < 0:
            raise ValueError("drain_seconds must not be negative")
        parse_cpus(self.transfer_cpus)  # a bad list fails here, not inside the engine
        # Orchestrators refuse heartbeats with a malformed id or address: fail here, saying why.
        check_host(self.host, "host (the address other processes reach this worker at)")
        for entry in self.orchestrators:
            parse_entry(entry)
        if self.orchestrator_resolve_seconds <= 0:
            raise ValueError("orchestrator_resolve_seconds must be positive")
        if self.worker_id:
            check_name(self.worker_id, "worker_id")
        check_transfer_link(self.transfer_link)
        parse_link_hosts(self.transfer_link_hosts)
        tracing.check(self.otlp_endpoint, self.otlp_protocol)
        if self.node_store:
            check_loopback_or_ipc(self.node_store)

    @property
    def long_prefill_step_tokens(self) -> int:
        """Prefill and decode workers cap one prompt's share of a step while other requests run
        or wait (vLLM lets a prompt alone take the whole budget); a unified worker does not
        (see ``UNIFIED_LONG_PREFILL_TOKENS``). On a decode worker a recompute or
        LOCAL prefill that took whole steps would hold every arriving request's KV pull
        (which starts, and is reported done, only at a step boundary) and every running
        stream's next token for seconds on CPU, and held pulls let producers' leases
        expire. On a prefill worker, a cache hit waiting beside a cold prompt would otherwise
        share one step with all of it: measured on one CPU core (SmolLM2-135M, float32), a
        58-token hit queued with a 1,300-token cold prompt got its first token after
        7.1 s uncapped and 4.4 s capped at 256, while a cold prompt alone took 3.7-3.9 s
        either way. In a real replay that hit waited 7.3 s where 2.5 s was estimated."""
        if self.long_prefill_tokens is not None:
            return self.long_prefill_tokens
        return default_long_prefill_tokens(self.role)

    def with_ports(self) -> WorkerSettings:
        """Concrete ports for every endpoint left at 0, and a worker id if missing."""
        pick = lambda port: port or free_port(self.bind_host)  # noqa: E731
        return replace(
            self,
            worker_id=self.worker_id or f"{self.role}-{self.incarnation[:8]}",
            rpc_port=pick(self.rpc_port),
            kv_events_port=pick(self.kv_events_port), transfer_port=pick(self.transfer_port))

    @property
    def rpc_address(self) -> str:
        return tcp(self.host, self.rpc_port)

    @property
    def kv_events_address(self) -> str:
        return tcp(self.host, self.kv_events_port)

    @property
    def transfer_address(self) -> str:
        return tcp(self.host, self.transfer_port)

    def configure_tracing(self) -> bool:
        """Export this worker's spans, if it has an OTLP endpoint (call once the worker id is set)."""
        return tracing.configure(f"kvroute-{self.role}-worker", self.otlp_endpoint, self.otlp_protocol,
                                 {"service.instance.id": self.worker_id, "kvroute.worker.role": self.role})

    def apply_environment(self) -> None:
        """Process-wide settings vLLM reads from the environment; call before the engine starts."""
        if self.omp_threads_bind:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_threads_bind
