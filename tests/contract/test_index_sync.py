"""WorkerIndexSync against a real ZMQ socket on 127.0.0.1 and a fake snapshot client.

The test owns the publishing socket and plays the engine: it chooses every sequence
number, including the ones it skips. The socket is an XPUB, which is a PUB to the
subscriber and also reports subscriptions, so the test knows when the subscriber has
joined (no slow-joiner sleeps) and when it has left.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from foundation import wire
from foundation.identity import block_hashes
from foundation.kv_events import AllBlocksCleared, KVEventBatch, stored_blocks
from foundation.netutil import free_port, tcp
from foundation.zmq_auth import secure_server
from orchestrator.index import PrefixIndex
from orchestrator.index_sync import KV_EVENTS_TOPIC, IndexSync, WorkerIndexSync
from orchestrator.registry import WorkerView
from orchestrator.worker_client import WorkerError
from tests.fake_engine import BS, OTHER_TENANT, FakeEngine, S, tokens

WORKER = "prefill-0"
INCARNATION = "inc-1"


class FakeClient:
    """Stands in for WorkerClient: ``snapshot()`` returns whatever the test set."""

    def __init__(self, snapshot: wire.KVSnapshot):
        self.next = snapshot
        self.calls = 0
        self.failures: list[Exception] = []
        self.called = asyncio.Event()

    async def snapshot(self, timeout: float = 30.0) -> wire.KVSnapshot:
        self.calls += 1
        self.called.set()
        if self.failures:
            raise self.failures.pop(0)
        return self.next


def snapshot_of(seq: int, *chains: tuple[FakeEngine, list[int], str]) -> wire.KVSnapshot:
    blocks = [wire.ResidentBlock(r.engine_hash, r.parent, list(r.token_ids),
                                 list(r.extra_keys) if r.extra_keys else None)
              for engine, toks, salt in chains for r in stored_blocks(engine.store(toks, salt))]
    return wire.KVSnapshot(request_id="snap", incarnation=INCARNATION, seq=seq, block_size=BS, blocks=blocks)


class Engine:
    """The publishing side: a bound XPUB socket the test drives."""

    def __init__(self):
        self.context = zmq.asyncio.Context()
        self.socket = secure_server(self.context.socket(zmq.XPUB), "worker")
        self.socket.setsockopt(zmq.LINGER, 0)
        self.address = tcp("127.0.0.1", free_port())
        self.socket.bind(self.address)

    async def subscription(self, timeout: float = 5.0) -> bytes:
        """The next (un)subscribe message: b'\\x01topic' or b'\\x00topic'."""
        return await asyncio.wait_for(self.socket.recv(), timeout)

    async def publish(self, seq: int, *events) -> None:
        payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=list(events)))
        await self.socket.send_multipart([KV_EVENTS_TOPIC, seq.to_bytes(8, "big"), payload])

    async def publish_raw(self, frames: list[bytes]) -> None:
        await self.socket.send_multipart(frames)

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture
async def engine():
    publisher = Engine()
    yield publisher
    publisher.close()


def view(address: str, worker_id: str = WORKER) -> WorkerView:
    return WorkerView(worker_id=worker_id, role="prefill", incarnation=INCARNATION, rpc_address="tcp://127.0.0.1:1",
                      load=wire.WorkerLoad(), last_seen=0.0, kv_events_address=address)


def match(index: PrefixIndex, toks: list[int], salt: str) -> int:
    return index.match(block_hashes(toks, BS, salt)).get(WORKER, 0)


async def until(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def started(engine: Engine, index: PrefixIndex, client: FakeClient, worker_id: str = WORKER):
    sync = WorkerIndexSync(index, view(engine.address, worker_id), client)
    task = asyncio.create_task(sync.run())
    assert await engine.subscription() == b"\x01" + KV_EVENTS_TOPIC  # subscribed: nothing published is lost
    await asyncio.wait_for(client.called.wait(), 5)
    await until(lambda: sync.resyncs >= 1, what="first snapshot loaded")
    return sync, task


async def stopped(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# ---------------------------------------------------------------- tests


async def test_skips_events_in_the_snapshot_and_applies_the_rest_in_order(engine):
    e = FakeEngine(1)
    base, old, older, new = tokens(3, 1), tokens(2, 2), tokens(2, 3), tokens(4, 4)
    index = PrefixIndex()
    client = FakeClient(snapshot_of(10, (e, base, S)))
    sync, task = await started(engine, index, client)
    try:
        assert sync.last_seq == 10
        assert match(index, base, S) == 3

        await engine.publish(9, e.store(older, S))  # already in the snapshot: skipped
        await engine.publish(10, e.store(old, S), e.remove(base, S, [0]))  # ditto
        await engine.publish(11, e.store(new, S, 0, 2))
        await engine.publish(12, e.store(new, S, 2, 4), e.remove(base, S, [1]))
        await until(lambda: sync.last_seq == 12, what="seq 12 applied")

        assert match(index, new, S) == 4
        assert match(index, base, S) == 1  # block 1 removed at seq 12; block 0's removal was skipped
        assert match(index, old, S) == 0 and match(index, older, S) == 0
        assert match(index, new, OTHER_TENANT) == 0
        assert (sync.gaps, sync.resyncs, client.calls) == (0, 1, 1)

        await engine.publish(12, e.store(old, S))  # a duplicate: skipped
        await engine.publish(13, AllBlocksCleared(), e.store(older, S))
        await until(lambda: sync.last_seq == 13, what="seq 13 applied")
        assert match(index, older, S) == 2
        assert match(index, old, S) == 0 and match(index, new, S) == 0 and match(index, base, S) == 0
        assert (sync.gaps, sync.resyncs) == (0, 1)
    finally:
        await stopped(task)


async def test_a_gap_triggers_a_resync_from_a_new_snapshot(engine):
    e = FakeEngine(2, int_hashes=True)
    a, b, c, d, f, g = (tokens(3, seed) for seed in range(20, 26))
    index = PrefixIndex()
    client = FakeClient(snapshot_of(3, (e, a, S)))
    sync, task = await started(engine, index, client)
    try:
        await engine.publish(4, e.store(b, S))
        await until(lambda: sync.last_seq == 4, what="seq 4 applied")
        assert match(index, a, S) == 3 and match(index, b, S) == 3

        # The worker's state moved on; seq 5 is "lost" on the wire.
        client.next = snapshot_of(7, (e, c, S), (e, a, S))
        await engine.publish(6, e.store(f, S))  # reveals the gap; not applied itself
        await until(lambda: sync.resyncs == 2, what="resync")
        assert sync.gaps == 1
        assert client.calls == 2
        assert sync.last_seq == 7
        assert match(index, c, S) == 3 and match(index, a, S) == 3
        assert match(index, b, S) == 0  # not in the new snapshot
        assert match(index, f, S) == 0

        await engine.publish(7, e.store(d, S))  # in the snapshot already: skipped
        await engine.publish(8, e.store(g, S))
        await until(lambda: sync.last_seq == 8, what="seq 8 applied")
        assert match(index, g, S) == 3 and match(index, d, S) == 0
        assert (sync.gaps, sync.resyncs) == (1, 2)

        # A second gap: the snapshot, already past the event that revealed it, replaces all.
        client.next = snapshot_of(12, (e, d, S))
        await engine.publish(11, e.store(f, S))
        await until(lambda: sync.resyncs == 3, what="second resync")
        assert sync.last_seq == 12 and match(index, d, S) == 3 and match(index, g, S) == 0
        await engine.publish(12, e.store(a, S))  # in the snapshot already: skipped
        await engine.publish(13, e.store(f, S))
        await until(lambda: sync.last_seq == 13, what="seq 13 applied")
        assert sync.gaps == 2
        assert match(index, f, S) == 3 and match(index, a, S) == 0
    finally:
        await stopped(task)


async def test_a_snapshot_behind_the_event_that_revealed_a_gap_is_asked_for_again(engine, monkeypatch):
    """The worker's own subscriber may not yet have applied the events we saw: its
    snapshot would lack their blocks, and no later event might come to reveal that."""
    monkeypatch.setattr("orchestrator.index_sync.STALE_SNAPSHOT_RETRY_SECONDS", 0.01)
    e = FakeEngine(4, int_hashes=True)
    a, b = tokens(3, 40), tokens(3, 41)
    index = PrefixIndex()
    client = FakeClient(snapshot_of(-1))
    sync, task = await started(engine, index, client)
    try:
        await engine.publish(2, e.store(a, S))  # events 0 and 1 went out before we subscribed
        await until(lambda: client.calls >= 4, what="the stale snapshot asked for again")
        assert sync.resyncs == 1 and match(index, a, S) == 0  # nothing loaded from a stale snapshot

        client.next = snapshot_of(2, (e, b, S), (e, a, S))  # the worker caught up
        await until(lambda: sync.resyncs == 2, what="resync from the caught-up snapshot")
        assert sync.last_seq == 2 and sync.gaps == 1
        assert match(index, a, S) == 3 and match(index, b, S) == 3
    finally:
        await stopped(task)


async def test_a_snapshot_that_never_catches_up_is_loaded_after_a_while(engine, monkeypatch):
    monkeypatch.setattr("orchestrator.index_sync.STALE_SNAPSHOT_RETRY_SECONDS", 0.01)
    monkeypatch.setattr("orchestrator.index_sync.STALE_SNAPSHOT_PATIENCE_SECONDS", 0.2)
    e = FakeEngine(5, int_hashes=True)
    a = tokens(3, 50)
    index = PrefixIndex()
    client = FakeClient(snapshot_of(-1))
    sync, task = await started(engine, index, client)
    try:
        client.next = snapshot_of(0, (e, a, S))
        await engine.publish(3, e.store(a, S))
        await until(lambda: sync.resyncs == 2, what="the stale snapshot loaded anyway")
        assert sync.last_seq == 0 and match(index, a, S) == 3
        assert client.calls > 2
    finally:
        await stopped(task)


async def test_cancelling_the_task_purges_the_worker_and_closes_the_socket(engine):
    e = FakeEngine(3)
    mine, theirs = tokens(3, 30), tokens(3, 31)
    index = PrefixIndex()
    index.reset_worker("decode-0", "other-inc")
    index.apply("decode-0", FakeEngine(4).store(theirs, S))
    client = FakeClient(snapshot_of(0, (e, mine, S)))
    sync, task = await started(engine, index, client)
    await engine.publish(1, e.store(theirs, S, 0, 2))
    await until(lambda: sync.last_seq == 1, what="seq 1 applied")
    assert index.match(block_hashes(theirs, BS, S)) == {WORKER: 2, "decode-0": 3}

    await stopped(task)
    assert task.cancelled()
    assert index.incarnation(WORKER) is None
    assert index.num_blocks(WORKER) == 0
    assert index.match(block_hashes(mine, BS, S)) == {}
    assert index.match(block_hashes(theirs, BS, S)) == {"decode-0": 3}  # other workers untouched
    assert await engine.subscription() == b"\x00" + KV_EVENTS_TOPIC  # unsubscribed: socket closed


async def test_undecodable_frames_are_skipped(engine):
    e = FakeEngine(5)
    toks = tokens(2, 40)
    index = PrefixIndex()
    client = FakeClient(snapshot_of(-1))  # before any event
    sync, task = await started(engine, index, client)
    try:
        assert index.num_blocks(WORKER) == 0 and index.incarnation(WORKER) == INCARNATION
        await engine.publish_raw([KV_EVENTS_TOPIC, (0).to_bytes(8, "big"), b"\xc1garbage"])
        await engine.publish_raw([KV_EVENTS_TOPIC, b"short"])
        await engine.publish(0, e.store(toks, S))
        await until(lambda: sync.last_seq == 0, what="seq 0 applied")
        assert match(index, toks, S) == 2
        assert (sync.gaps, sync.resyncs) == (0, 1)

        # An undecodable batch still used up a sequence number: its events are lost, so
        # the next batch shows a gap and the index is rebuilt from a snapshot.
        more = tokens(3, 41)
        client.next = snapshot_of(2, (e, toks, S), (e, more, S))
        await engine.publish_raw([KV_EVENTS_TOPIC, (1).to_bytes(8, "big"), b"\x93truncated"])
        await engine.publish(2, e.store(more, S))
        await until(lambda: sync.resyncs == 2, what="resync after a lost batch")
        assert sync.gaps == 1 and sync.last_seq == 2
        assert match(index, more, S) == 3 and match(index, toks, S) == 2
    finally:
        await stopped(task)


async def test_snapshot_failures_are_retried(engine):
    e = FakeEngine(6)
    toks = tokens(2, 50)
    index = PrefixIndex()
    client = FakeClient(snapshot_of(5, (e, toks, S)))
    client.failures.append(WorkerError("busy", "try later"))
    sync, task = await started(engine, index, client)
    try:
        assert client.calls == 2 and sync.resyncs == 1
        assert match(index, toks, S) == 2
    finally:
        await stopped(task)


async def test_index_sync_starts_and_stops_per_worker(engine):
    e = FakeEngine(7)
    toks = tokens(3, 60)
    index = PrefixIndex()
    syncs = IndexSync(index)
    client = FakeClient(snapshot_of(0, (e, toks, S)))

    syncs.worker_up(view("", "no-events"), FakeClient(snapshot_of(0)))  # no KV events: no task
    assert syncs.stats("no-events") == (0, 0)

    syncs.worker_up(view(engine.address), client)
    assert await engine.subscription() == b"\x01" + KV_EVENTS_TOPIC
    await until(lambda: syncs.stats(WORKER) == (1, 0), what="first snapshot")
    assert match(index, toks, S) == 3
    client.next = snapshot_of(2, (e, toks, S))
    await engine.publish(2, e.store(tokens(1, 61), S))  # gap
    await until(lambda: syncs.stats(WORKER) == (2, 1), what="resync")

    syncs.worker_down(WORKER)
    assert index.incarnation(WORKER) is None and match(index, toks, S) == 0
    assert syncs.stats(WORKER) == (0, 0)
    assert await engine.subscription() == b"\x00" + KV_EVENTS_TOPIC

    syncs.worker_up(view(engine.address), client)
    assert await engine.subscription() == b"\x01" + KV_EVENTS_TOPIC
    await until(lambda: index.num_blocks(WORKER) == 3, what="restarted sync")
    await syncs.stop()
    assert await engine.subscription() == b"\x00" + KV_EVENTS_TOPIC
