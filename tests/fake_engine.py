"""What one vLLM engine publishes as KV events, faked: its own chained block hashes (seeded per
engine, bytes or ints, never equal to kvroute's), the cache salt in the first block's extra
keys, the LoRA name first in every block's extra keys. For the index's tests and its sync's."""

from __future__ import annotations

import hashlib
import random

from foundation.identity import Namespace
from foundation.kv_events import BlockRemoved, BlockStored

BS = 16
MODEL = "smollm2-135m@abc123"
S = Namespace(MODEL, tenant="acme").cache_salt()
OTHER_TENANT = Namespace(MODEL, tenant="globex").cache_salt()
LORA = "sql-lora"
S_LORA = Namespace(MODEL, adapter=LORA, tenant="acme").cache_salt()


def tokens(n_blocks: int, seed: int, extra: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 49_152) for _ in range(n_blocks * BS + extra)]


class FakeEngine:
    """One vLLM engine's prefix-cache hashing and event shapes."""

    def __init__(self, seed: int, int_hashes: bool = False):
        self.seed = seed
        self.int_hashes = int_hashes

    def hashes(self, toks: list[int], salt: str | None, lora: str | None = None) -> list:
        out = []
        parent = f"engine-{self.seed}".encode()
        for i in range(len(toks) // BS):
            keys = (lora or "", salt or "") if i == 0 else (lora or "",)
            digest = hashlib.sha256(repr((parent, toks[i * BS:(i + 1) * BS], keys)).encode()).digest()
            parent = digest
            out.append(int.from_bytes(digest[:8], "big") if self.int_hashes else digest)
        return out

    def store(self, toks: list[int], salt: str | None, first: int = 0, last: int | None = None,
              lora: str | None = None) -> BlockStored:
        """BlockStored for blocks [first, last) of ``toks``, chained to block first-1."""
        hashes = self.hashes(toks, salt, lora)
        last = len(hashes) if last is None else last
        extra = []
        for i in range(first, last):
            keys = ([lora] if lora else []) + ([salt] if i == 0 and salt else [])
            extra.append(keys or None)
        return BlockStored(block_hashes=hashes[first:last], parent_block_hash=hashes[first - 1] if first else None,
                           token_ids=toks[first * BS:last * BS], block_size=BS, lora_id=1 if lora else None,
                           medium="GPU", lora_name=lora,
                           extra_keys=extra if any(k is not None for k in extra) else None)

    def remove(self, toks: list[int], salt: str | None, blocks: list[int], lora: str | None = None) -> BlockRemoved:
        hashes = self.hashes(toks, salt, lora)
        return BlockRemoved(block_hashes=[hashes[i] for i in blocks], medium="GPU")
