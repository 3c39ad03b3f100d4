"""API keys → tenant, scope and role. The tenant and scope enter the cache namespace, so
one tenant's prompts never reuse (or reveal, through timing) another tenant's KV state.

Key file (YAML or JSON)::

    keys:
      sk-team-a-123: {tenant: team-a, scope: default}
      sk-team-b-456: {tenant: team-b, rate_limit: 5, burst: 10}
      sk-ops-789: {tenant: ops, admin: true}

Only SHA-256 digests of the keys are kept in memory, and keys never reach the logs.
A key's ``rate_limit`` (requests per second, 0: none) and ``burst`` set its tenant's rate
limit in place of the orchestrator's ``tenant_rate_limit`` (see orchestrator.rate_limit);
keys of one tenant must not disagree on it. ``admin: true`` lets a key use the ``/admin``
routes and read every tenant's decision records; other keys see their tenant's only.

The file is read strictly: a file that defines no key, or a field kvroute does not know
(a typo such as ``admn: true`` would otherwise silently leave a key without its role),
stops the start. Without a key file every request is the one principal ``anonymous``,
which may do everything: the listener's address is then the only boundary (see
``OrchestratorSettings``: a non-loopback host needs keys or ``allow_unauthenticated``).
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

KEY_FIELDS = ("tenant", "scope", "admin", "rate_limit", "burst")
EXPECTED = (f"expected a top-level 'keys:' mapping of API keys to a tenant name or to "
            f"{{{', '.join(KEY_FIELDS)}}} (tenant required)")


@dataclass(frozen=True)
class Principal:
    tenant: str = "anonymous"
    scope: str = "default"
    admin: bool = False


ANONYMOUS = Principal(admin=True)  # no keys configured: nobody to tell apart


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
        entries = _key_entries(read_config_file(Path(path)), path)
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


def require_admin(principal: Principal) -> None:
    """403 for a key without ``admin: true`` (after ``authenticate``, which answers 401)."""
    if not principal.admin:
        raise APIError(403, "this route needs an admin API key ('admin: true' in the key file)",
                       code="admin_key_required")


def _key_entries(data: dict, path) -> dict:
    unknown = sorted(set(data) - {"keys"})
    entries = data.get("keys")
    if unknown or not isinstance(entries, dict) or not entries:
        # Only hints: a top-level name may be an API key put there by mistake.
        found = f"; found {', '.join(repr(str(name)[:4] + '…') for name in unknown)}" if unknown else ""
        raise ConfigError(f"{path}: {EXPECTED}{found}")
    return entries


def _principal(key_hint: str, value, path) -> Principal:
    if isinstance(value, str) and value:
        return Principal(tenant=value)
    if not isinstance(value, dict) or not value.get("tenant"):
        raise ConfigError(f"{path}: the entry for key {key_hint}… needs a tenant; {EXPECTED}")
    unknown = sorted(set(value) - set(KEY_FIELDS))
    if unknown:
        raise ConfigError(f"{path}: the entry for key {key_hint}… has unknown fields {', '.join(map(repr, unknown))}; "
                          f"a key's fields are {', '.join(KEY_FIELDS)}")
    admin = value.get("admin", False)
    if not isinstance(admin, bool):
        raise ConfigError(f"{path}: the entry for key {key_hint}… needs admin: true or false")
    return Principal(tenant=str(value["tenant"]), scope=str(value.get("scope", "default")), admin=admin)


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
