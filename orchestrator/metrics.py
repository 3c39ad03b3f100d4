"""Prometheus metrics of the orchestrator, in their own registry (served at /metrics).

Latencies are measured here, at the orchestrator, as clients experience them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvroute_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("kvroute_requests_in_flight", "completions being served", registry=r)
        self.ttft = Histogram("kvroute_time_to_first_token_seconds", "request arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.second_token = Histogram("kvroute_time_to_second_token_seconds",
                                      "first to second token (the prefill→decode hand-off)",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("kvroute_inter_token_latency_seconds", "gap between later tokens",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvroute_e2e_request_latency_seconds", "request arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvroute_prompt_tokens", "prompt tokens received", registry=r)
        self.cached_tokens = Counter("kvroute_cached_prompt_tokens",
                                     "prompt tokens the prefilling engine found in its cache", registry=r)
        self.generation_tokens = Counter("kvroute_generation_tokens", "completion tokens returned", registry=r)
        self.workers = Gauge("kvroute_workers", "live workers by role", ["role"], registry=r)
        self.worker_failures = Counter("kvroute_worker_failures", "requests failed by a worker error",
                                       ["role"], registry=r)
