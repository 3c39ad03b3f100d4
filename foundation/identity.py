"""Cache identity: when two requests may share KV state.

Token equality is not enough. A request's **namespace** covers everything that changes
the meaning of KV: model and weights, tokenizer and chat template, adapter, tenant and
authorisation scope. The namespace becomes

* the ``cache_salt`` given to vLLM, so an engine's prefix cache never shares blocks
  across namespaces, and
* the seed of kvroute's chained block hashes, so the index never matches across them.

Block hashes cover full blocks only: hash_i = H(hash_{i-1} ‖ tokens of block i), with
hash_{-1} derived from the salt. They are kvroute's own; vLLM's engine hashes are
mapped onto them per worker, never assumed equal.
"""

from __future__ import annotations

import functools
import hashlib
import json
from array import array
from dataclasses import asdict, dataclass

import xxhash

SALT_PREFIX = "kvr1-"


@dataclass(frozen=True)
class Namespace:
    model_fingerprint: str  # model, weights revision, tokenizer and chat template (model_prep)
    adapter: str = ""  # LoRA adapter name; empty for the base model
    tenant: str = "anonymous"
    scope: str = "default"  # authorisation scope within the tenant

    def cache_salt(self, secret: bytes | None = None) -> str:
        """Stable, opaque, and different for any difference in any field. ``secret``: the
        cluster's salt secret (foundation.cluster_keys), which keys the hash, so knowing a
        tenant's name and the model gives no salt to probe its cache with; None: unkeyed
        (a cluster run with --insecure-no-auth)."""
        return _cache_salt(self, secret)


@functools.lru_cache(maxsize=4096)  # computed on every request; a deployment has few namespaces
def _cache_salt(namespace: Namespace, secret: bytes | None) -> str:
    canonical = json.dumps(asdict(namespace), sort_keys=True, separators=(",", ":"))
    return SALT_PREFIX + hashlib.blake2b(canonical.encode(), key=secret or b"", digest_size=16).hexdigest()


BlockHash = int


def chain_seed(cache_salt: str | None) -> BlockHash:
    """hash_{-1}: the root every chain in this namespace grows from."""
    return xxhash.xxh3_128_intdigest(b"kvroute-namespace\x00" + (cache_salt or "").encode())


def next_block_hash(parent: BlockHash, block_token_ids) -> BlockHash:
    return _chain(parent, array("I", block_token_ids).tobytes())


def _chain(parent: BlockHash, block_bytes: bytes) -> BlockHash:
    return xxhash.xxh3_128_intdigest(parent.to_bytes(16, "little") + block_bytes)


def block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (a partial tail has none)."""
    # One conversion of the whole prompt, then byte slices: converting per block dominated.
    encoded = array("I", token_ids).tobytes()
    stride = 4 * block_size
    hashes: list[BlockHash] = []
    parent = chain_seed(cache_salt)
    for start in range(0, len(encoded) - stride + 1, stride):
        parent = _chain(parent, encoded[start:start + stride])
        hashes.append(parent)
    return hashes
