"""Prometheus metrics of the orchestrator, in their own registry (served at /metrics).

Latencies are measured here, at the orchestrator, as clients experience them.

Series labelled with a worker id are made through ``_per_worker``, which remembers them
by worker, so that a worker that left the fleet takes its series with it at the next
scrape (``refresh_fleet``): ids come and go with restarts and scaling, and a series kept
per id ever seen would grow without bound.
"""

from __future__ import annotations

import contextlib
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from foundation import wire

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Actual over estimated TTFT: 1 is a perfect estimate; the buckets are dense around it.
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.1, 1.25, 1.5, 2, 4, 10)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvroute_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("kvroute_requests_in_flight", "completions being served", registry=r)
        self.rejected = Counter("kvroute_requests_rejected", "requests refused with 429: no feasible plan",
                                registry=r)
        self.rate_limited = Counter("kvroute_rate_limited", "requests refused with 429: over the tenant's rate limit",
                                    ["tenant"], registry=r)
        self.ttft = Histogram("kvroute_time_to_first_token_seconds", "request arrival to first token",
                              ["policy", "plan"], buckets=LATENCY_BUCKETS, registry=r)
        self.second_token = Histogram("kvroute_time_to_second_token_seconds",
                                      "first to second token (the prefill→decode hand-off)",
                                      ["policy", "plan"], buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("kvroute_inter_token_latency_seconds", "mean gap between later tokens",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvroute_e2e_request_latency_seconds", "request arrival to last token",
                             ["policy"], buckets=LATENCY_BUCKETS, registry=r)
        self.decode_stall = Histogram("kvroute_decode_stall_seconds",
                                      "what a prefill stalled the streams decoding on its worker, summed over them "
                                      "(orchestrator.decode_streams), by the plan that prefilled there",
                                      ["policy", "plan"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvroute_prompt_tokens", "prompt tokens placed, per prefilling worker",
                                     ["worker"], registry=r)
        self.prefix_tokens = Histogram("kvroute_prompt_length_tokens", "prompt length", buckets=TOKEN_BUCKETS,
                                       registry=r)
        self.estimated_reused = Counter("kvroute_estimated_reused_tokens", "prompt tokens the plan expected to reuse",
                                        ["worker"], registry=r)
        self.cached_tokens = Counter("kvroute_cached_prompt_tokens",
                                     "prompt tokens the prefilling engine found in its cache", ["worker"], registry=r)
        self.tier_tokens = Counter("kvroute_tier_prompt_tokens",
                                   "of the cached prompt tokens, those loaded from the node KV tier", ["worker"],
                                   registry=r)
        self.tier_load_bytes = Counter("kvroute_tier_load_bytes", "KV bytes loaded from a node KV store, per "
                                       "loading worker and tier", ["worker", "tier"], registry=r)
        self.tier_load_seconds = Histogram("kvroute_tier_load_seconds", "a request's node-store load, from its "
                                           "lookup to the load's end, per tier", ["tier"], buckets=LATENCY_BUCKETS,
                                           registry=r)
        self.tier_misses = Counter("kvroute_tier_misses", "requests that loaded fewer tokens from the node KV store "
                                   "than planned", ["worker"], registry=r)
        self.tier_indexed_blocks = Gauge("kvroute_tier_indexed_blocks", "blocks the orchestrator knows a node KV "
                                         "store holds, per store and tier", ["node", "store", "tier"], registry=r)
        self._stores_exported: set[tuple[str, str]] = set()
        self.generation_tokens = Counter("kvroute_generation_tokens", "completion tokens returned", registry=r)
        self.ttft_estimate_ratio = Histogram("kvroute_ttft_estimate_ratio",
                                             "actual TTFT over the chosen plan's estimate (1: exact)",
                                             ["policy"], buckets=RATIO_BUCKETS, registry=r)
        self.awaiting_capacity = Gauge("kvroute_requests_awaiting_capacity",
                                       "requests waiting for a worker under its concurrency cap", registry=r)
        self.worker_waiting = Gauge("kvroute_worker_requests_waiting",
                                    "requests waiting in the worker's engine (from its heartbeat)", ["worker"],
                                    registry=r)
        self.worker_queued_prefill_tokens = Gauge("kvroute_worker_queued_prefill_tokens",
                                                  "prompt tokens still to compute on the worker (from its heartbeat)",
                                                  ["worker"], registry=r)
        self.plans = Counter("kvroute_plans", "placements by policy and plan kind", ["policy", "plan"], registry=r)
        self.selected = Counter("kvroute_worker_selected", "placements per worker and role", ["worker", "role"],
                                registry=r)
        self.index_mispredictions = Counter("kvroute_index_mispredictions",
                                            "requests that reused fewer tokens than the index predicted",
                                            ["worker"], registry=r)
        self.claim_misses = Counter("kvroute_claim_misses",
                                    "requests that reused fewer tokens than claimed for a request prefilling there",
                                    ["worker"], registry=r)
        self.index_blocks = Gauge("kvroute_index_blocks", "blocks indexed per worker", ["worker"], registry=r)
        self.evicted_blocks = Counter("kvroute_evicted_blocks",
                                      "blocks a worker's engine evicted from its prefix cache (from its KV events)",
                                      ["worker"], registry=r)
        self._evictions_exported: dict[str, int] = {}
        self._worker_series: dict[str, set[tuple[object, tuple[str, ...]]]] = {}  # worker id -> (metric, labels)
        self._breakers_exported: set[str] = set()
        self.transfer_bytes = Counter("kvroute_transfer_bytes", "KV bytes pulled, per link",
                                      ["source", "destination"], registry=r)
        self.transfer_seconds = Histogram("kvroute_transfer_seconds", "time of one KV pull, per link",
                                          ["source", "destination"], buckets=LATENCY_BUCKETS, registry=r)
        self.workers = Gauge("kvroute_workers", "live workers by role", ["role"], registry=r)
        self.draining_workers = Gauge("kvroute_workers_draining",
                                      "workers finishing their requests before they stop, by role "
                                      "(not counted in kvroute_workers)", ["role"], registry=r)
        self.worker_failures = Counter("kvroute_worker_failures", "placements ended by a worker error",
                                       ["role"], registry=r)
        self.breaker_state = Gauge("kvroute_worker_breaker_state",
                                   "circuit breaker per worker: 0 closed, 1 half-open (a probe may go), "
                                   "2 open (out of rotation)", ["worker"], registry=r)
        self.migrations = Counter("kvroute_request_migrations",
                                  "requests moved to another worker after one failed", ["role"], registry=r)
        for role in wire.ROLES:  # at 0 from the start, so that the first failure shows in rate() and increase()
            self.worker_failures.labels(role)
            self.migrations.labels(role)

    def observe_request(self, job, plan, handoff, record) -> None:
        kind = plan.kind.value
        prefilling = plan.prefilling_worker
        self.plans.labels(record.policy, kind).inc()
        for role, worker in (("prefill", plan.prefill_worker), ("decode", plan.decode_worker),
                             ("source", plan.source_worker)):
            if worker:
                self._per_worker(self.selected, (worker,), worker, role).inc()
        self._per_worker(self.prompt_tokens, (prefilling,), prefilling).inc(len(job.prompt_token_ids))
        self.prefix_tokens.observe(len(job.prompt_token_ids))
        self._per_worker(self.estimated_reused, (prefilling,), prefilling).inc(record.predicted_reused_tokens)
        self._per_worker(self.cached_tokens, (prefilling,), prefilling).inc(handoff.prefill_cached_tokens)
        self._per_worker(self.tier_tokens, (prefilling,), prefilling).inc(handoff.prefill_tier_tokens)
        self.generation_tokens.inc(record.actual.completion_tokens)
        self._observe_latencies(job, handoff, record.policy, kind)
        if record.actual.stall_seconds is not None:
            self.decode_stall.labels(record.policy, kind).observe(record.actual.stall_seconds)
        if plan.estimate is not None and plan.estimate.ttft > 0 and record.actual.ttft is not None:
            self.ttft_estimate_ratio.labels(record.policy).observe(record.actual.ttft / plan.estimate.ttft)

    def observe_rate_limited(self, tenant: str) -> None:
        self.rate_limited.labels(tenant).inc()

    def observe_misprediction(self, worker_id: str) -> None:
        self._per_worker(self.index_mispredictions, (worker_id,), worker_id).inc()

    def observe_claim_miss(self, worker_id: str) -> None:
        self._per_worker(self.claim_misses, (worker_id,), worker_id).inc()

    def refresh_fleet(self, fleet, index, tiers=None) -> None:
        """Gauges read from the fleet, the index and the node stores' holdings (``tiers``)
        when /metrics is scraped; the series of workers and stores gone are removed."""
        if tiers is not None:
            self._export_stores(tiers)
        for role in wire.ROLES:
            workers = fleet.live(role)
            self.workers.labels(role).set(len(workers))
            self.draining_workers.labels(role).set(len(fleet.draining(role)))
            for worker in workers:
                self._export_worker(worker, index)
        self._forget_departed({worker.worker_id for worker in fleet.registry.live()})
        # From the breakers, not the live workers: an open breaker is what takes a worker out of them.
        states = fleet.breakers.states(time.monotonic())
        for worker_id, state in states.items():
            self.breaker_state.labels(worker_id).set(state.value)
        for gone in self._breakers_exported - states.keys():  # a worker marked down or restarted
            self.breaker_state.remove(gone)
        self._breakers_exported = set(states)

    def _export_worker(self, worker, index) -> None:
        worker_id = worker.worker_id
        self._per_worker(self.index_blocks, (worker_id,), worker_id).set(index.num_blocks(worker_id))
        self._per_worker(self.worker_waiting, (worker_id,), worker_id).set(worker.load.num_waiting)
        self._per_worker(self.worker_queued_prefill_tokens, (worker_id,), worker_id).set(
            worker.load.num_queued_prefill_tokens)
        # Counters of rare events start at 0, so the first one shows in rate() and increase().
        for rare in (self.index_mispredictions, self.claim_misses, self.tier_misses):
            self._per_worker(rare, (worker_id,), worker_id)
        self._export_evictions(worker_id, index.num_evicted(worker_id))

    def _export_evictions(self, worker_id: str, evicted: int) -> None:
        exported = self._evictions_exported.get(worker_id, 0)
        new = evicted - exported if evicted >= exported else evicted  # the index's count restarted
        if new > 0:
            self._per_worker(self.evicted_blocks, (worker_id,), worker_id).inc(new)
        self._evictions_exported[worker_id] = evicted

    def _export_stores(self, tiers) -> None:
        stores = set(tiers.stores())
        for node, address in stores:
            for tier in ("host", "disk"):
                self.tier_indexed_blocks.labels(node, address, tier).set(tiers.num_blocks((node, address), tier))
        for node, address in self._stores_exported - stores:
            for tier in ("host", "disk"):
                with contextlib.suppress(KeyError):
                    self.tier_indexed_blocks.remove(node, address, tier)
        self._stores_exported = stores

    def observe_tier_load(self, worker_id: str, tier: str, num_bytes: int, seconds: float) -> None:
        self._per_worker(self.tier_load_bytes, (worker_id,), worker_id, tier).inc(num_bytes)
        self.tier_load_seconds.labels(tier).observe(seconds)

    def observe_tier_miss(self, worker_id: str) -> None:
        self._per_worker(self.tier_misses, (worker_id,), worker_id).inc()

    def observe_transfer(self, source: str, destination: str, num_bytes: int, seconds: float) -> None:
        link = (source, destination)
        self._per_worker(self.transfer_bytes, link, *link).inc(num_bytes)
        self._per_worker(self.transfer_seconds, link, *link).observe(seconds)

    def _per_worker(self, metric, workers: tuple[str, ...], *labels: str):
        """``metric``'s series for ``labels``, remembered under each of ``workers``."""
        for worker_id in workers:
            self._worker_series.setdefault(worker_id, set()).add((metric, labels))
        return metric.labels(*labels)

    def _forget_departed(self, registered: set[str]) -> None:
        for worker_id in set(self._worker_series) - registered:
            for metric, labels in self._worker_series.pop(worker_id):
                with contextlib.suppress(KeyError):  # a link's series goes with the first of its two ends
                    metric.remove(*labels)
        for worker_id in set(self._evictions_exported) - registered:
            del self._evictions_exported[worker_id]

    def _observe_latencies(self, job, handoff, policy: str, kind: str) -> None:
        if handoff.first_token_at is None:
            return
        self.ttft.labels(policy, kind).observe(handoff.first_token_at - job.arrived_at)
        done = time.perf_counter()
        self.e2e.labels(policy).observe(done - job.arrived_at)
        if handoff.second_token_at is None:
            return
        self.second_token.labels(policy, kind).observe(handoff.second_token_at - handoff.first_token_at)
        later_tokens = len(handoff.token_ids) - 2
        if later_tokens > 0:
            self.inter_token.observe((done - handoff.second_token_at) / later_tokens)
