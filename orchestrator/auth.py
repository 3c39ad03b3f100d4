"""API keys → tenant and scope. The tenant and scope enter the cache namespace, so one
tenant's prompts never reuse (or reveal, through timing) another tenant's KV state.

Key file (YAML or JSON)::

    keys:
      sk-team-a-123: {tenant: team-a, scope: default}
      sk-team-b-456: {tenant: team-b}

Only SHA-256 digests of the keys are kept in memory, and keys never reach the logs.
Without a key file every request is the tenant ``anonymous``.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from kvroute.config import ConfigError, read_config_file
from orchestrator.errors import APIError


@dataclass(frozen=True)
class Principal:
    tenant: str = "anonymous"
    scope: str = "default"


ANONYMOUS = Principal()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, principals: dict[bytes, Principal]):
        self._principals = principals

    @property
    def enabled(self) -> bool:
        return bool(self._principals)

    @classmethod
    def disabled(cls) -> "ApiKeys":
        return cls({})

    @classmethod
    def from_file(cls, path: str | Path) -> "ApiKeys":
        data = read_config_file(Path(path))
        entries = data.get("keys", data)
        if not isinstance(entries, dict) or not entries:
            raise ConfigError(f"{path}: expected a mapping of API keys to {{tenant, scope}}")
        return cls({_digest(str(key)): _principal(str(key)[:4], value, path) for key, value in entries.items()})

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


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
