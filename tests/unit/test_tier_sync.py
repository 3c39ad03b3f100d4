"""Following the node stores (orchestrator.tier_sync) with fake worker clients: a store is
read through the first of its workers that answers, from where the last read stopped; one
that no worker can reach, or whose last worker left, is forgotten."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from foundation import wire
from orchestrator.tier_holdings import TierHoldings, TierRun
from orchestrator.tier_sync import TierSync
from orchestrator.worker_client import WorkerError

ADDRESS = "tcp://127.0.0.1:7000"
HASHES = [11, 12]


class FakeClient:
    def __init__(self, replies=(), failing=False):
        self.replies = list(replies)
        self.failing = failing
        self.asked: list[tuple[int, str]] = []

    async def tier_events(self, since: int, epoch: str, timeout: float) -> wire.TierEventsReply:
        self.asked.append((since, epoch))
        if self.failing:
            raise WorkerError("unavailable", "the node store at tcp://127.0.0.1:7000 did not answer")
        return self.replies.pop(0)


def worker(worker_id: str, store: str = ADDRESS):
    return SimpleNamespace(worker_id=worker_id, node_store=("10.0.0.1", store) if store else None)


def stored(*blocks: int, seq: int, snapshot: bool = False) -> wire.TierEventsReply:
    return wire.TierEventsReply(epoch="run-1", seq=seq, snapshot=snapshot,
                                events=[wire.TierEvent(True, "host", b.to_bytes(16, "little")) for b in blocks])


async def test_a_store_is_read_through_the_first_worker_that_answers_from_where_it_stopped():
    holdings = TierHoldings()
    sync = TierSync(holdings, poll_seconds=60)
    down, up = FakeClient(failing=True), FakeClient([stored(11, seq=1, snapshot=True), stored(12, seq=2)])
    sync.worker_up(worker("w0"), down)
    sync.worker_up(worker("w1"), up)
    sync.worker_up(worker("w2", store=""), FakeClient())  # a worker without a store is not followed
    store = ("10.0.0.1", ADDRESS)
    assert await sync.poll(store) and await sync.poll(store)
    assert up.asked == [(0, ""), (1, "run-1")]
    assert holdings.run(store, HASHES, 0) == TierRun(2, 0) and store not in sync.errors
    await sync.stop()


async def test_a_store_no_worker_reaches_is_forgotten_with_why():
    holdings = TierHoldings()
    sync = TierSync(holdings, poll_seconds=60)
    client = FakeClient([stored(11, seq=1, snapshot=True)])
    sync.worker_up(worker("w0"), client)
    store = ("10.0.0.1", ADDRESS)
    assert await sync.poll(store)
    client.failing = True
    assert not await sync.poll(store)
    assert holdings.run(store, HASHES, 0) == TierRun() and "did not answer" in sync.errors[store]
    await sync.stop()


async def test_the_last_worker_leaving_forgets_the_store_and_stops_following_it():
    holdings = TierHoldings()
    sync = TierSync(holdings, poll_seconds=0.01)
    client = FakeClient([stored(11, seq=1, snapshot=True)] + [stored(seq=1) for _ in range(1000)])
    sync.worker_up(worker("w0"), client)
    store = ("10.0.0.1", ADDRESS)
    for _ in range(100):  # the following task's first poll
        if holdings.num_blocks(store):
            break
        await asyncio.sleep(0.01)
    assert holdings.num_blocks(store) == 1
    sync.worker_down("w0")
    asked = len(client.asked)
    await asyncio.sleep(0.05)
    assert holdings.stores() == [] and len(client.asked) == asked
    await sync.stop()
