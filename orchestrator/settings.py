"""Orchestrator settings (see foundation.config for how flags, env and files map onto them)."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

from foundation import tracing, zmq_auth
from foundation.config import setting
from orchestrator.circuit_breaker import BreakerSettings
from orchestrator.pending_blocks import PendingSettings
from orchestrator.planner.policies import POLICIES
from orchestrator.planner.settings import DEFAULT_TPOT_TARGET_SECONDS, TPOT_TARGET_BOUNDS, PlannerSettings
from orchestrator.rate_limit import RateLimit
from orchestrator.recent_activity import RecentActivity
from orchestrator.retry import RetryPolicy


@dataclass(frozen=True)
class OrchestratorSettings:
    host: str = setting("127.0.0.1", "HTTP interface to bind")
    port: int = setting(8000, "HTTP port of the OpenAI-compatible API")
    registry_host: str = setting("127.0.0.1", "interface where workers register and heartbeat")
    registry_port: int = setting(7001, "port where workers register and heartbeat")
    model: str | None = setting(None, "model folder or hub id; default: SmolLM2-135M-Instruct, prepared on demand")
    served_model_name: str = setting("", "model name clients use; default: the model folder's name")
    max_model_len: int = setting(8192, "longest prompt + completion in tokens; must match the workers")
    policy: str = setting("cache_aware", f"placement policy, one of {', '.join(POLICIES)}")
    allow_policy_override: bool = setting(False, "let a request choose its policy with the header "
                                                 "X-KVRoute-Policy (for side-by-side experiments)")
    gap_bound_seconds: float = setting(0.25, "largest acceptable hand-off (first to second token) "
                                             "before the planner trades TTFT for it")
    tie_band: float = setting(0.1, "plans costing within this fraction of the cheapest are ties, won by the "
                                   "emptiest cache (so new prefixes spread over the pool)")
    top_k: int = setting(4, "candidates kept per pool and ranking before plans are enumerated")
    tpot_target_seconds: float = setting(DEFAULT_TPOT_TARGET_SECONDS,
                                         "time per output token each stream is promised, unless its request "
                                         "asks for another (docs/api.md): the planner charges in full the stall "
                                         "a prefill would add past it to the streams decoding on its worker; "
                                         "0: no target")
    max_in_flight_per_worker: int = setting(PlannerSettings.max_in_flight,
                                            "hotspot cap: a worker with this many requests takes no more (vLLM's "
                                            "default batch limit)")
    max_queued_prefill_tokens: int = setting(16384, "hotspot cap on a worker's queued prompt tokens")
    heartbeat_timeout_seconds: float = setting(10.0, "a worker silent for this long is marked down")
    tier_index_poll_seconds: float = setting(0.25, "how often the node KV stores' new blocks are read (through "
                                                   "a worker on each), for the planner to price tier loads")
    registry_max_frame_bytes: int = setting(1 << 20, "largest message the registry reads; libzmq drops the "
                                                     "connection of a peer that sends a larger one")
    max_workers: int = setting(1024, "most workers registered at once; a heartbeat from another worker id is "
                                     "refused while the fleet is full")
    worker_timeout_seconds: float = setting(60.0, "longest wait for the next token from a worker, unless the "
                                                  "worker is busy with its queue and still holds the request")
    queue_wait_limit_seconds: float = setting(600.0, "longest wait for a first token in the queue of a worker "
                                                     "that is busy with its queue; past it the request fails "
                                                     "(queue_timeout), or moves, without counting against the "
                                                     "worker")
    admission_wait_seconds: float = setting(10.0, "when every worker is at its cap, wait this long for "
                                                  "capacity before answering 429")
    max_attempts: int = setting(3, "placements per request: a worker failure moves the request (prompt plus "
                                   "the tokens already sent) to another worker this many times minus one")
    breaker_failure_threshold: int = setting(5, "circuit breaker: this many consecutive failed requests (errors "
                                                "or timeouts) take a worker out of rotation")
    breaker_window_seconds: float = setting(30.0, "circuit breaker: failures older than this are forgotten")
    breaker_cooldown_seconds: float = setting(10.0, "circuit breaker: after this long out of rotation one probe "
                                                    "request goes to the worker; its success brings it back")
    rpc_retry_attempts: int = setting(3, "attempts of the idempotent worker calls (stats, snapshot, cache reset; "
                                         "never generate), with exponential backoff and jitter")
    rpc_retry_base_seconds: float = setting(0.1, "backoff before the second attempt; doubling up to 2 s, "
                                                 "minus up to half at random")
    max_request_bytes: int = setting(8 * 2**20, "larger request bodies get 413, whether declared by "
                                                "Content-Length or sent chunked (refused as soon as the limit "
                                                "is passed)")
    max_prompts_per_request: int = setting(16, "most prompts one /v1/completions request may carry (400 beyond); "
                                               "each is counted against its tenant's rate limit")
    max_stop_sequences: int = setting(4, "most stop strings a request may give (400 beyond; OpenAI's limit)")
    max_stop_length: int = setting(256, "longest stop string in characters (400 beyond)")
    tokenize_in_thread_chars: int = setting(4096, "prompts of at least this many characters in a request are "
                                                   "tokenized on a worker thread, so a large body does not stall "
                                                   "the event loop that streams every other request")
    cluster_keys: str = setting("", "the cluster's key folder (`kvroute keys init DIR`): the registry and every "
                                    "ZeroMQ socket are authenticated and encrypted with it; `kvroute serve` "
                                    "makes one for its run when none is given")
    insecure_no_auth: bool = setting(False, "no cluster keys: ZeroMQ sockets in clear, open to anyone who reaches "
                                            "them; only on a network nobody else can reach")
    transfer_encryption: str = setting("on", "on: KV bytes under CURVE too; off: in clear, and transfer endpoints "
                                             "open to any peer, only on fabrics nobody else can reach; alike on "
                                             "every process of the cluster (docs/security.md)")
    api_keys: str = setting("", "YAML/JSON file mapping API keys to a tenant, scope and role (admin: true); "
                                "empty: no keys")
    allow_unauthenticated: bool = setting(False, "serve without api_keys on a host other than loopback (every "
                                                 "client is then an admin); without it such a start is refused")
    admin_host: str = setting("127.0.0.1", "interface of the separate admin listener (only with admin_port)")
    admin_port: int = setting(0, "port of a separate listener for /admin/*, /metrics and the status page "
                                 "/ui, which the API port then no longer serves; 0: all on the API port")
    tenant_rate_limit: float = setting(0.0, "completion prompts per second each tenant may send (a token bucket "
                                            "per tenant; a chat request is one prompt, a /v1/completions request "
                                            "one per prompt; over it: 429 and the seconds to wait); a key's "
                                            "rate_limit in the key file overrides it for its tenant; 0: no limit")
    tenant_burst: int = setting(0, "prompts a tenant may send at once (the bucket's size); 0: "
                                   "tenant_rate_limit rounded up, at least 1")
    keep_alive_seconds: float = setting(15.0, "seconds an idle HTTP keep-alive connection stays open; above "
                                              "the clients' own expiry (httpx, so the openai package: 5 s), "
                                              "so that a client never sends on a connection the server is "
                                              "closing, and short enough that idle clients do not hold "
                                              "connections (raise it above a load balancer's idle timeout)")
    max_connections: int = setting(1024, "open HTTP connections plus running requests per listener; past it "
                                         "a new request gets 503 (uvicorn's limit_concurrency)")
    header_timeout_seconds: float = setting(10.0, "a connection that has not sent a whole request head (request "
                                                  "line and headers) this long after it opened, or after its "
                                                  "request's first byte, is closed")
    max_header_bytes: int = setting(65536, "largest request head (request line and headers); beyond it the "
                                           "request gets 431 and the connection is closed")
    status_window_seconds: float = setting(300.0, "how far back the status page (/ui, /admin/status) shows TTFT "
                                                  "and hit rate")
    status_bucket_seconds: float = setting(10.0, "the status page's time resolution: requests are summed in "
                                                 "buckets this long (memory: window / bucket buckets)")
    otlp_endpoint: str = setting("", "OpenTelemetry collector to send request traces to, e.g. http://127.0.0.1:4318 "
                                     "(http) or http://127.0.0.1:4317 (grpc); `kvroute serve` gives it to its "
                                     "workers too; empty: no tracing (docs/operations.md#tracing)")
    otlp_protocol: str = setting("http", f"OTLP transport of otlp_endpoint: {' or '.join(tracing.PROTOCOLS)} "
                                         f"(http: protobuf over HTTP)")
    log_level: str = setting("info", "log level: debug, info, warning, error")
    access_log: bool = setting(False, "log a line per HTTP request (uvicorn's access log); every completion "
                                      "already gets one on kvroute.decisions")

    def __post_init__(self):
        if self.transfer_encryption not in ("on", "off"):
            raise ValueError(f"transfer_encryption must be 'on' or 'off', got {self.transfer_encryption!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.registry_max_frame_bytes < 4096 or self.max_workers < 1:
            raise ValueError("registry_max_frame_bytes must be at least 4096 and max_workers at least 1")
        if not 0.01 <= self.tier_index_poll_seconds <= 60:
            raise ValueError("tier_index_poll_seconds must be between 0.01 and 60")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        low, high = TPOT_TARGET_BOUNDS
        if self.tpot_target_seconds != 0 and not low <= self.tpot_target_seconds <= high:
            raise ValueError(f"tpot_target_seconds must be 0 (no target) or from {low:g} to {high:g}")
        self.breaker_settings(), self.retry_policy(), self.recent_activity()  # their own checks, at start-up
        if not (0 <= self.tenant_rate_limit < math.inf) or self.tenant_burst < 0:
            raise ValueError("tenant_rate_limit and tenant_burst must be finite and not negative")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if not (0 < self.keep_alive_seconds < math.inf and 0 < self.header_timeout_seconds < math.inf):
            raise ValueError("keep_alive_seconds and header_timeout_seconds must be positive and finite")
        if min(self.max_request_bytes, self.max_prompts_per_request, self.max_stop_sequences, self.max_stop_length,
               self.max_connections, self.max_header_bytes) < 1 or self.tokenize_in_thread_chars < 0:
            raise ValueError("max_request_bytes, max_prompts_per_request, max_stop_sequences, max_stop_length, "
                             "max_connections and max_header_bytes must be at least 1, tokenize_in_thread_chars "
                             "not negative")
        self._check_exposure()
        tracing.check(self.otlp_endpoint, self.otlp_protocol)
        if not (0 < self.worker_timeout_seconds < math.inf and 0 <= self.queue_wait_limit_seconds < math.inf):
            raise ValueError("worker_timeout_seconds must be positive and queue_wait_limit_seconds not negative, "
                             "both finite")

    def _check_exposure(self) -> None:
        """Without keys every client is an admin: only loopback may be that open unless asked."""
        exposed = [host for host in (self.host, self.admin_host if self.admin_port else self.host)
                   if not is_loopback(host)]
        if exposed and not self.api_keys and not self.allow_unauthenticated:
            raise ValueError(f"refusing to serve on {exposed[0]} without --api-keys: anyone who can reach it could "
                             f"use and administer the cluster; give --api-keys FILE, or --allow-unauthenticated "
                             f"on a network you trust")

    @property
    def separate_admin_listener(self) -> bool:
        return self.admin_port != 0

    def pending_settings(self) -> PendingSettings:
        """Claims on blocks a dispatched request will store live as long as it may wait."""
        return PendingSettings(max_age_seconds=self.queue_wait_limit_seconds + self.worker_timeout_seconds)

    def http_server_options(self, admin: bool = False) -> dict:
        """uvicorn's options for the OpenAI-compatible API (``admin``: for the separate admin
        listener). The request-head limits are applied by ``orchestrator.http_server``."""
        host, port = (self.admin_host, self.admin_port) if admin else (self.host, self.port)
        return {"host": host, "port": port, "loop": "uvloop", "log_level": self.log_level,
                "access_log": self.access_log, "timeout_keep_alive": self.keep_alive_seconds,
                "limit_concurrency": self.max_connections}

    def planner_settings(self) -> PlannerSettings:
        return PlannerSettings(gap_bound_seconds=self.gap_bound_seconds, tie_band=self.tie_band, top_k=self.top_k,
                               max_in_flight=self.max_in_flight_per_worker,
                               max_queued_prefill_tokens=self.max_queued_prefill_tokens)

    def breaker_settings(self) -> BreakerSettings:
        return BreakerSettings(failure_threshold=self.breaker_failure_threshold,
                               failure_window_seconds=self.breaker_window_seconds,
                               cooldown_seconds=self.breaker_cooldown_seconds)

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(attempts=self.rpc_retry_attempts, base_delay_seconds=self.rpc_retry_base_seconds)

    def recent_activity(self) -> RecentActivity:
        return RecentActivity(self.status_window_seconds, self.status_bucket_seconds)

    def default_rate_limit(self) -> RateLimit | None:
        """The limit of every tenant whose keys set none; None: not limited."""
        return RateLimit.of(self.tenant_rate_limit, self.tenant_burst)

    def configure_security(self) -> None:
        """How this process's ZeroMQ sockets speak (foundation.zmq_auth); at start."""
        zmq_auth.configure_from_flags(self.cluster_keys, self.insecure_no_auth, "orchestrator",
                                      self.transfer_encryption == "on")

    def configure_tracing(self) -> bool:
        """Export this process's spans, if it has an OTLP endpoint (foundation.tracing); at start."""
        return tracing.configure("kvroute-orchestrator", self.otlp_endpoint, self.otlp_protocol)

    @property
    def registry_address(self) -> str:
        return f"tcp://{self.registry_host}:{self.registry_port}"


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address; any other name counts as exposed, as it may resolve anywhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
