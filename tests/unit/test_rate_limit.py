"""Per-tenant token buckets (orchestrator.rate_limit), their settings and the key file's
per-key limits, with a fake clock. The HTTP behaviour is in tests/integration/test_rate_limit_http.py."""

from __future__ import annotations

import json

import pytest

from foundation import config
from foundation.config import ConfigError
from orchestrator.auth import ApiKeys
from orchestrator.errors import APIError
from orchestrator.rate_limit import RateLimit, TenantRateLimits, TokenBucket
from orchestrator.settings import OrchestratorSettings


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("rate, burst, expected", [
    (0, 0, None),
    (0, 7, None),
    (2, 0, RateLimit(2, 2)),
    (0.5, 0, RateLimit(0.5, 1)),
    (2.5, 0, RateLimit(2.5, 3)),
    (5, 10, RateLimit(5, 10)),
])
def test_rate_limit_of(rate, burst, expected):
    assert RateLimit.of(rate, burst) == expected


@pytest.mark.parametrize("rate, burst", [(-1, 0), (1, -1)])
def test_negative_limits_are_refused(rate, burst):
    with pytest.raises(ValueError):
        RateLimit.of(rate, burst)


def test_bucket_starts_full_and_refuses_without_taking():
    bucket = TokenBucket(RateLimit(rate=2, burst=3), now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.5)  # one token at 2/s
    assert bucket.take(0.0) == pytest.approx(0.5)  # a refusal took nothing
    assert bucket.take(0.25) == pytest.approx(0.25)
    assert bucket.take(0.5) == 0.0


def test_bucket_refills_up_to_its_burst_only():
    bucket = TokenBucket(RateLimit(rate=1, burst=2), now=0.0)
    bucket.take(0.0), bucket.take(0.0)
    assert [bucket.take(1000.0) for _ in range(3)] == [0.0, 0.0, pytest.approx(1.0)]


def test_a_clock_stepping_back_refills_nothing():
    bucket = TokenBucket(RateLimit(rate=1, burst=1), now=10.0)
    assert bucket.take(10.0) == 0.0
    assert bucket.take(5.0) == pytest.approx(1.0)
    assert bucket.take(10.5) == pytest.approx(0.5)  # time counts from the latest reading


def test_tenants_have_their_own_buckets_and_overrides():
    limits = TenantRateLimits(RateLimit(1, 1), {"vip": RateLimit(10, 5), "internal": None})
    assert limits.take("team-a", 0.0) == 0.0
    assert limits.take("team-a", 0.0) == pytest.approx(1.0)
    assert limits.take("team-b", 0.0) == 0.0  # unaffected by team-a
    assert [limits.take("vip", 0.0) for _ in range(6)] == [0.0] * 5 + [pytest.approx(0.1)]
    assert all(limits.take("internal", 0.0) == 0.0 for _ in range(100))


def test_only_overrides_limit_when_there_is_no_default():
    limits = TenantRateLimits(None, {"batch": RateLimit(1, 1)})
    assert limits.enabled
    assert all(limits.take("team-a", 0.0) == 0.0 for _ in range(100))
    assert limits.take("batch", 0.0) == 0.0 and limits.take("batch", 0.0) > 0
    assert not TenantRateLimits().enabled and not TenantRateLimits(None, {"x": None}).enabled


def test_admit_raises_429_with_retry_after_rounded_up_and_counts():
    clock, limited = FakeClock(), []
    limits = TenantRateLimits(RateLimit(rate=0.4, burst=2), clock=clock, on_limited=limited.append)
    limits.admit("team-a"), limits.admit("team-a")
    with pytest.raises(APIError) as refused:
        limits.admit("team-a")
    error = refused.value
    assert error.status == 429 and error.code == "rate_limit_exceeded"
    assert error.headers == {"Retry-After": "3"}  # 1 token at 0.4/s: 2.5 s, rounded up
    assert error.body()["error"]["type"] == "rate_limit_error"
    assert limited == ["team-a"]
    clock.now += 2.0
    with pytest.raises(APIError) as again:
        limits.admit("team-a")
    assert again.value.headers == {"Retry-After": "1"}  # 0.5 s left, rounded up to a whole second
    clock.now += 0.5
    limits.admit("team-a")
    assert limited == ["team-a", "team-a"]


def test_a_request_takes_a_token_per_prompt():
    clock, limited = FakeClock(), []
    limits = TenantRateLimits(RateLimit(rate=2, burst=16), clock=clock, on_limited=limited.append)
    limits.admit("team-a", cost=16)
    with pytest.raises(APIError) as refused:
        limits.admit("team-a", cost=3)
    assert refused.value.headers == {"Retry-After": "2"}  # 3 tokens at 2/s: 1.5 s, rounded up
    clock.now += 1.0
    limits.admit("team-a", cost=2)  # the refusal took nothing
    with pytest.raises(APIError) as never:
        limits.admit("team-a", cost=17)  # more than the bucket holds: no wait would help
    assert never.value.status == 429 and "Retry-After" not in never.value.headers
    assert "17 prompts" in never.value.message and "at most 16" in never.value.message
    assert limited == ["team-a", "team-a"]


def test_admit_without_limits_never_reads_the_clock():
    def clock():
        raise AssertionError("read the clock")

    limits = TenantRateLimits(clock=clock)
    for _ in range(10):
        limits.admit("anonymous")


# ---------------------------------------------------------------- configuration


def keys_file(tmp_path, entries: dict):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": entries}))
    return path


def test_key_file_sets_tenant_limits(tmp_path):
    keys = ApiKeys.from_file(keys_file(tmp_path, {
        "sk-a-1": {"tenant": "team-a", "rate_limit": 5, "burst": 10},
        "sk-a-2": {"tenant": "team-a", "rate_limit": 5, "burst": 10},
        "sk-b": {"tenant": "team-b", "rate_limit": 0.5},
        "sk-c": {"tenant": "team-c", "rate_limit": 0},
        "sk-d": {"tenant": "team-d"},
        "sk-e": "team-e",
    }))
    assert keys.rate_limits == {"team-a": RateLimit(5, 10), "team-b": RateLimit(0.5, 1), "team-c": None}
    assert keys.authenticate("Bearer sk-a-2").tenant == "team-a"


@pytest.mark.parametrize("entries, message", [
    ({"sk-a-1": {"tenant": "a", "rate_limit": 5}, "sk-a-2": {"tenant": "a", "rate_limit": 6}},
     "keys of tenant a set different rate limits"),
    ({"sk-a-1": {"tenant": "a", "rate_limit": -1}}, "needs a rate_limit >= 0"),
    ({"sk-a-1": {"tenant": "a", "rate_limit": "fast"}}, "needs a rate_limit >= 0"),
    ({"sk-a-1": {"tenant": "a", "rate_limit": True}}, "needs a rate_limit >= 0"),
    ({"sk-a-1": {"tenant": "a", "rate_limit": 1, "burst": 2.5}}, "a whole burst >= 0"),
    ({"sk-a-1": {"tenant": "a", "burst": 3}}, "needs a rate_limit >= 0"),
])
def test_bad_key_file_limits(tmp_path, entries, message):
    with pytest.raises(ConfigError, match=message) as refused:
        ApiKeys.from_file(keys_file(tmp_path, entries))
    assert "sk-a-1" not in str(refused.value)  # only a four-character hint of a key


def test_settings_default_off_and_from_environment():
    assert OrchestratorSettings().default_rate_limit() is None
    settings = config.load(OrchestratorSettings, None, environ={"KVROUTE_TENANT_RATE_LIMIT": "2.5",
                                                                "KVROUTE_TENANT_BURST": "4"})
    assert settings.default_rate_limit() == RateLimit(2.5, 4)
    assert OrchestratorSettings(tenant_rate_limit=3).default_rate_limit() == RateLimit(3, 3)


@pytest.mark.parametrize("values", [{"tenant_rate_limit": -1}, {"tenant_burst": -2},
                                    {"tenant_rate_limit": float("inf")}, {"tenant_rate_limit": float("nan")}])
def test_settings_refuse_bad_limits(values):
    with pytest.raises(ValueError, match="tenant_rate_limit and tenant_burst"):
        OrchestratorSettings(**values)
