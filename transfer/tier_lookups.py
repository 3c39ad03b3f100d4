"""Node-store lookups off vLLM's scheduler thread.

The store answers a lookup in a millisecond when idle, but it serves one message at a time,
and a write-through of a long prompt ahead of the lookup (tens of MB copied and checksummed)
holds it back for tens of milliseconds on a busy host. Waiting for that on the scheduler
thread would stall every running request's next step; giving up early would recompute a
prompt the store holds. So the lookup runs on a thread of its own, and vLLM is told "not
yet" (``None`` from ``get_num_new_matched_tokens``): it skips the request for this step,
schedules the others, and asks again at the next. The client's own deadline bounds each
lookup; a store that missed one is left alone for a while (``transfer.node_store.client``).
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from typing import Protocol

from foundation.lru import LruDict

logger = logging.getLogger("kvroute.transfer.tier")

REMEMBERED_LOOKUPS = 4096  # requests asked about but not yet admitted; vLLM may ask again


class LookupClient(Protocol):
    available: bool

    def leading(self, keys: list[bytes]) -> int: ...


class Executor(Protocol):
    def submit(self, fn, /, *args) -> concurrent.futures.Future: ...


@dataclass
class _Lookup:
    first_block: int  # the local hit it looked beyond
    answer: concurrent.futures.Future


class TierLookups:
    """Single caller (the scheduler thread); the lookups themselves run on ``executor``."""

    def __init__(self, client: LookupClient, executor: Executor | None = None):
        self.client = client
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvroute-tier-lookup")
        self._lookups: LruDict[str, _Lookup] = LruDict(REMEMBERED_LOOKUPS)

    def leading(self, request_id: str, first_block: int, keys: list[bytes]) -> int | None:
        """How many of ``keys`` (the prompt's blocks from ``first_block``), from the first,
        the store holds; None while its answer is on the way. A lookup is made once per
        local hit: vLLM asks again each step until it has the answer."""
        lookup = self._lookups.get(request_id)
        if lookup is None or lookup.first_block != first_block:
            if not self.client.available:
                return 0
            lookup = _Lookup(first_block, self._executor.submit(self._ask, keys))
            self._lookups[request_id] = lookup
        if not lookup.answer.done():
            return None
        return lookup.answer.result()

    def forget(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)

    def _ask(self, keys: list[bytes]) -> int:
        try:
            return self.client.leading(keys)
        except Exception:  # a lookup that fails is a miss, never a stuck request
            logger.exception("node store lookup failed")
            return 0
