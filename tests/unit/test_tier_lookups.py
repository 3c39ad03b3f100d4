"""Node-store lookups off the scheduler thread (transfer.tier_lookups): "not yet" while the
store's answer is on the way, the answer once in, one lookup per local hit, and a store that
fails or is left alone costs a miss, never a stuck request."""

from __future__ import annotations

import threading
import time

from transfer.tier_lookups import TierLookups

KEYS = [bytes([i]) * 16 for i in range(4)]


class GatedStore:
    """Answers each lookup once ``gate`` is set."""

    def __init__(self, held: int, available: bool = True, error: Exception | None = None):
        self.held = held
        self.available = available
        self.error = error
        self.gate = threading.Event()
        self.asked: list[list[bytes]] = []

    def leading(self, keys: list[bytes]) -> int:
        self.asked.append(keys)
        assert self.gate.wait(10), "the test never let the store answer"
        if self.error is not None:
            raise self.error
        return min(self.held, len(keys))


def answer(lookups: TierLookups, request_id: str, first: int, keys: list[bytes], timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while (found := lookups.leading(request_id, first, keys)) is None:
        assert time.monotonic() < deadline, "the lookup never finished"
        time.sleep(0.005)
    return found


def test_the_scheduler_is_told_not_yet_until_the_store_answers():
    store = GatedStore(held=3)
    lookups = TierLookups(store)
    assert lookups.leading("r1", 0, KEYS) is None
    assert lookups.leading("r1", 0, KEYS) is None  # asked again: still on the way, not asked twice
    store.gate.set()
    assert answer(lookups, "r1", 0, KEYS) == 3
    assert store.asked == [KEYS]


def test_a_changed_local_hit_is_looked_up_again():
    store = GatedStore(held=4)
    store.gate.set()
    lookups = TierLookups(store)
    assert answer(lookups, "r1", 0, KEYS) == 4
    assert answer(lookups, "r1", 2, KEYS[2:]) == 2
    assert store.asked == [KEYS, KEYS[2:]]


def test_a_forgotten_request_is_looked_up_afresh():
    store = GatedStore(held=1)
    store.gate.set()
    lookups = TierLookups(store)
    answer(lookups, "r1", 0, KEYS)
    lookups.forget("r1")
    answer(lookups, "r1", 0, KEYS)
    assert len(store.asked) == 2


def test_a_store_left_alone_is_a_miss_at_once():
    store = GatedStore(held=4, available=False)
    assert TierLookups(store).leading("r1", 0, KEYS) == 0
    assert store.asked == []


def test_a_failing_lookup_is_a_miss(caplog):
    store = GatedStore(held=4, error=RuntimeError("socket closed"))
    store.gate.set()
    assert answer(TierLookups(store), "r1", 0, KEYS) == 0
    assert "node store lookup failed" in caplog.text
