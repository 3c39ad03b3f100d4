"""What a request carries for the connector in vLLM's ``kv_transfer_params``, and the digest
that ties a pull source to one prompt. Kept apart from the connector (which imports vLLM's
connector base, seconds of start-up) so the worker's RPC and the synthetic workers of the
tests reach it cheaply."""

from __future__ import annotations

import hashlib
from typing import Any

PARAMS_KEY = "kvroute"


def prompt_digest(token_ids: list[int], cache_salt: str | None) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update((cache_salt or "").encode())
    digest.update(b"\x00")
    digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return digest.hexdigest()


def kvroute_params(request: Any) -> dict:
    params = getattr(request, "kv_transfer_params", None) or {}
    return params.get(PARAMS_KEY) or {}
