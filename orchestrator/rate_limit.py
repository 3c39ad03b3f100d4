"""Per-tenant rate limits on the completion routes: one token bucket per tenant.

A bucket holds up to ``burst`` tokens and refills at ``rate`` tokens a second. Each
prompt of a completion request takes one (a ``/v1/completions`` request with 16 prompts
costs the engines 16 requests' work, so it takes 16); a request that finds fewer tokens
than it needs is refused with 429 and ``Retry-After``, the seconds until enough are back
(rounded up), and takes nothing. A request needing more than the burst can never be
admitted: its 429 says so and carries no ``Retry-After``.
Limits are optional: the orchestrator's ``tenant_rate_limit`` sets one for every tenant,
and a key's ``rate_limit`` in the key file sets its tenant's own (0: no limit for it).

Tenants come from the key file (or are the one tenant ``anonymous``), so the number of
buckets is bounded by it. ``TokenBucket`` and ``TenantRateLimits.take`` are pure: time
comes in as ``now``. ``admit`` is the shell the HTTP API calls; it reads the injected
clock. Single writer: the HTTP API's event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from orchestrator.errors import APIError


@dataclass(frozen=True)
class RateLimit:
    rate: float  # requests per second, > 0
    burst: int  # the bucket's size: requests that may arrive at once, >= 1

    def __post_init__(self):
        if not self.rate > 0 or self.burst < 1:
            raise ValueError(f"a rate limit needs rate > 0 and burst >= 1, not {self.rate} and {self.burst}")

    @classmethod
    def of(cls, rate: float, burst: int = 0) -> RateLimit | None:
        """None for rate 0 (no limit). Burst 0: the rate rounded up, at least 1."""
        if rate < 0 or burst < 0:
            raise ValueError(f"rate and burst must not be negative, not {rate} and {burst}")
        return cls(rate, burst or max(1, math.ceil(rate))) if rate > 0 else None


class TokenBucket:
    """Starts full. ``now`` is monotonic seconds; a clock that steps back refills nothing."""

    def __init__(self, limit: RateLimit, now: float):
        self.limit = limit
        self.tokens = float(limit.burst)
        self.updated = now

    def take(self, now: float, cost: int = 1) -> float:
        """Take ``cost`` tokens (at most the burst): 0.0 if there were as many, else the seconds
        until they are back (nothing taken)."""
        self._refill(now)
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.limit.rate

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(float(self.limit.burst), self.tokens + elapsed * self.limit.rate)
        self.updated = max(self.updated, now)


class TenantRateLimits:
    """``default`` applies to every tenant not in ``per_tenant``; a tenant mapped to None is
    not limited. Without any limit, ``admit`` does nothing."""

    def __init__(self, default: RateLimit | None = None, per_tenant: Mapping[str, RateLimit | None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_limited: Callable[[str], None] = lambda tenant: None):
        self.default = default
        self.per_tenant = dict(per_tenant or {})
        self.clock, self.on_limited = clock, on_limited
        self._buckets: dict[str, TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return self.default is not None or any(limit is not None for limit in self.per_tenant.values())

    def limit_of(self, tenant: str) -> RateLimit | None:
        return self.per_tenant[tenant] if tenant in self.per_tenant else self.default

    def take(self, tenant: str, now: float, cost: int = 1) -> float:
        """Take ``cost`` tokens from ``tenant``'s bucket: 0.0 if admitted, else the seconds to
        wait (``math.inf``: more than its burst, never)."""
        limit = self.limit_of(tenant)
        if limit is None:
            return 0.0
        if cost > limit.burst:
            return math.inf
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = TokenBucket(limit, now)
        return bucket.take(now, cost)

    def admit(self, tenant: str, cost: int = 1) -> None:
        """Admit a request of ``tenant`` that costs ``cost`` tokens (its prompts) or raise the
        429 it gets."""
        if not self.enabled:
            return
        wait = self.take(tenant, self.clock(), cost)
        if wait > 0:
            self.on_limited(tenant)
            raise rate_limited(self.limit_of(tenant), wait, cost)


def rate_limited(limit: RateLimit, wait_seconds: float, cost: int = 1) -> APIError:
    if wait_seconds == math.inf:
        return APIError(429, f"this request has {cost} prompts, each counted against the rate limit, but this API "
                             f"key's tenant may send at most {limit.burst} at once; split it into smaller requests",
                        param="prompt", code="rate_limit_exceeded")
    retry_after = max(1, math.ceil(wait_seconds))
    return APIError(429, f"rate limit exceeded: {limit.rate:g} prompts/s, burst {limit.burst}, for this "
                         f"API key's tenant; retry after {retry_after} s",
                    code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)})
