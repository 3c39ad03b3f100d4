"""API keys → tenant and scope. The tenant and scope enter the cache namespace, so one
tenant's prompts never reuse (or reveal, through timing) another tenant's KV state.

Key file (YAML or JSON)::

    keys:
      sk-team-a-123: {tenant: team-a, scope: default}
      sk-team-b-456: {tenant: team-b, rate_limit: 5, burst: 10}

Only SHA-256 digests of the keys are kept in memory, and keys never reach the logs.
Without a key file every request is the tenant ``anonymous``. A key's ``rate_limit``
(requests per second, 0: none) and ``burst`` set its tenant's rate limit in place of the
orchestrator's ``tenant_rate_limit`` (see orchestrator.rate_limit); keys of one tenant
must not disagree on it.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass
from pathlib import Path

from foundation.config import ConfigError, read_config_file
from orchestrator.errors import APIError
from orchestrator.rate_limit import RateLimit


@dataclass(frozen=True)
class Principal:
    tenant: str = "anonymous"
    scope: str = "default"


ANONYMOUS = Principal()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, principals: dict[bytes, Principal], rate_limits: dict[str, RateLimit | None] | None = None):
        """``rate_limits``: the tenants whose keys set one (None: not limited)."""
        self._principals = principals
        self.rate_limits = rate_limits or {}

    @property
    def enabled(self) -> bool:
        return bool(self._principals)

    @classmethod
    def disabled(cls) -> ApiKeys:
        return cls({})

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        data = read_config_file(Path(path))
        entries = data.get("keys", data)
        if not isinstance(entries, dict) or not entries:
            raise ConfigError(f"{path}: expected a mapping of API keys to {{tenant, scope}}")
        principals, rate_limits = {}, {}
        for key, value in entries.items():
            hint = str(key)[:4]
            principal = principals[_digest(str(key))] = _principal(hint, value, path)
            if isinstance(value, dict) and ("rate_limit" in value or "burst" in value):
                limit = _rate_limit(hint, value, path)
                if rate_limits.setdefault(principal.tenant, limit) != limit:
                    raise ConfigError(f"{path}: the keys of tenant {principal.tenant} set different rate limits")
        return cls(principals, rate_limits)

    def authenticate(self, authorization: str | None) -> Principal:
        if not self.enabled:
            return ANONYMOUS
        if not authorization or not authorization.lower().startswith("bearer "):
            raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        offered = _digest(authorization[7:].strip())
        for digest, principal in self._principals.items():
            if hmac.compare_digest(digest, offered):
                return principal
        raise _unauthorized("invalid API key")


def _principal(key_hint: str, value, path) -> Principal:
    if isinstance(value, str):
        return Principal(tenant=value)
    if not isinstance(value, dict) or not value.get("tenant"):
        raise ConfigError(f"{path}: the entry for key {key_hint}… needs a tenant")
    return Principal(tenant=str(value["tenant"]), scope=str(value.get("scope", "default")))


def _rate_limit(key_hint: str, value: dict, path) -> RateLimit | None:
    rate, burst = value.get("rate_limit"), value.get("burst", 0)
    if not (_is_number(rate) and rate >= 0 and _is_number(burst) and burst >= 0 and burst == int(burst)):
        raise ConfigError(f"{path}: the entry for key {key_hint}… needs a rate_limit >= 0 (requests per "
                          f"second) and a whole burst >= 0")
    return RateLimit.of(float(rate), int(burst))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
