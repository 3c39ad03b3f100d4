"""What a simulation reports: one record per request, and a summary per policy.

Times are simulated seconds from the request's arrival. TTFT is when the first token
leaves the prefilling engine (the prefill worker for DISAGG, the decode worker for
LOCAL); queue time is arrival to that engine's first scheduling of the request
(admission waits included); E2E is arrival to the last token. ``cached_tokens`` is the
prefilling engine's prefix-cache hit, as ``usage.prompt_tokens_details.cached_tokens``
reports it in service: with node stores, the tokens loaded from its node's store too
(``tier_tokens``, of which ``tier_disk_tokens`` from its disk tier; the load took
``tier_load_seconds`` of the TTFT). A rejected request (no feasible plan within the admission wait,
a 429 in service) has no timings.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

FINISHED, REJECTED = "finished", "rejected"


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    index: int
    arrival_seconds: float
    status: str
    prompt_tokens: int
    output_tokens: int
    plan: str = ""  # "local" | "disagg"
    prefill_worker: str = ""  # the worker that prefilled (the decode worker for LOCAL)
    decode_worker: str = ""
    cached_tokens: int = 0
    predicted_reused_tokens: int = 0  # the plan's estimate
    estimated_ttft_seconds: float | None = None
    queue_seconds: float | None = None
    ttft_seconds: float | None = None
    second_token_gap_seconds: float | None = None
    e2e_seconds: float | None = None
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    tier_tokens: int = 0  # of ``cached_tokens``, loaded from the node store
    tier_disk_tokens: int = 0
    tier_load_seconds: float = 0.0
    predicted_tier_tokens: int = 0  # the plan's estimate

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PolicySummary:
    policy: str
    requests: int
    finished: int
    rejected: int
    ttft_p50: float | None
    ttft_p99: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    queue_p50: float | None
    prompt_tokens: int
    cached_tokens: int
    local_plans: int
    disagg_plans: int
    transfer_bytes: int
    tier_tokens: int = 0  # of ``cached_tokens``, loaded from node stores

    @property
    def hit_rate(self) -> float:
        """Cached over prompt tokens of the finished requests (node-store loads included)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tier_hit_rate(self) -> float:
        """Of ``hit_rate``, the share loaded from node stores rather than hit in an engine's cache."""
        return self.tier_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "tier_hit_rate": self.tier_hit_rate}


def percentile(values: list[float], q: float, method: str = "linear") -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, None if there are none. ``method`` as numpy's:
    ``linear`` (its default) interpolates between the closest ranks; ``higher`` takes the sample
    at or above the rank, which at q = 99 is the sample of 0-based rank int(0.99 n). The one
    percentile of the simulator and the measurements (``kvroute.bench``)."""
    return float(np.percentile(values, q, method=method)) if values else None


def summarize(policy: str, records: Iterable[RequestRecord]) -> PolicySummary:
    records = list(records)
    done = [r for r in records if r.status == FINISHED]
    ttft = [r.ttft_seconds for r in done]
    e2e = [r.e2e_seconds for r in done]
    return PolicySummary(
        policy=policy, requests=len(records), finished=len(done), rejected=len(records) - len(done),
        ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
        e2e_p50=percentile(e2e, 50), e2e_p99=percentile(e2e, 99),
        queue_p50=percentile([r.queue_seconds for r in done], 50),
        prompt_tokens=sum(r.prompt_tokens for r in done), cached_tokens=sum(r.cached_tokens for r in done),
        local_plans=sum(1 for r in done if r.plan == "local"), disagg_plans=sum(1 for r in done if r.plan == "disagg"),
        transfer_bytes=sum(r.transfer_bytes for r in done), tier_tokens=sum(r.tier_tokens for r in done))
