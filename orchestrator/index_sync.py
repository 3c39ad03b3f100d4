"""Keeping the prefix index in step with every worker's engine.

Per live worker incarnation, one task::

    subscribe to its KV events ─▶ load its snapshot (stamped with seq S)
        ─▶ apply events with seq > S, in order
        ─▶ a gap in the sequence numbers (events lost) ─▶ reload the snapshot

The worker builds its snapshot from the same event stream, read by its own subscriber,
which may be behind ours: a snapshot older than an event we have already seen would
miss that event's blocks, so it is asked for again until it has caught up.

The worker going down or restarting cancels the task and purges its entries, so no
request is ever planned against a cache that is gone.
"""

from __future__ import annotations

import asyncio
import logging

import zmq

from foundation import kv_events, wire
from foundation.netutil import async_context
from foundation.zmq_auth import secure_client
from orchestrator.index import PrefixIndex
from orchestrator.registry import WorkerView
from orchestrator.worker_client import WorkerClient, WorkerError

logger = logging.getLogger("kvroute.orchestrator.index_sync")

STALE_SNAPSHOT_RETRY_SECONDS = 0.05
# How long a snapshot may stay behind the events seen before it is taken as it is (the
# next event then reveals the gap again). The worker's subscriber lags by milliseconds
# unless its process is starved.
STALE_SNAPSHOT_PATIENCE_SECONDS = 5.0

KV_EVENTS_TOPIC = b"kv-events"


def snapshot_records(snapshot: wire.KVSnapshot) -> list[kv_events.StoredBlockRecord]:
    return [kv_events.StoredBlockRecord(b.engine_hash, b.parent, tuple(b.token_ids),
                                        tuple(b.extra_keys) if b.extra_keys else None) for b in snapshot.blocks]


class WorkerIndexSync:
    """Owns one worker's SUB socket; the only writer of that worker's index entries."""

    def __init__(self, index: PrefixIndex, worker: WorkerView, client: WorkerClient):
        self.index = index
        self.worker = worker
        self.client = client
        self.last_seq = -1
        self.seen_seq = -1  # the highest sequence number received, applied or not
        self.resyncs = 0
        self.gaps = 0
        self._resyncing = False

    async def run(self) -> None:
        socket = secure_client(async_context().socket(zmq.SUB), "worker")
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, KV_EVENTS_TOPIC)
        socket.connect(self.worker.kv_events_address)
        try:
            await self._resync()
            while True:
                self._on_frames(await socket.recv_multipart())
                if self.last_seq == _NEEDS_RESYNC:
                    await self._resync()
        finally:
            socket.close(linger=0)
            self.index.purge(self.worker.worker_id)

    async def resync_now(self) -> None:
        """Reload the snapshot out of band (e.g. after the index mispredicted a hit)."""
        if not self._resyncing:
            await self._resync()

    async def _resync(self) -> None:
        self._resyncing = True
        try:
            await self._load_snapshot()
        finally:
            self._resyncing = False

    async def _load_snapshot(self) -> None:
        give_up_waiting = None
        while True:
            snapshot = await self._fetch_snapshot()
            if snapshot.seq >= self.seen_seq:
                break
            now = asyncio.get_running_loop().time()
            give_up_waiting = give_up_waiting or now + STALE_SNAPSHOT_PATIENCE_SECONDS
            if now >= give_up_waiting:
                logger.warning("snapshot of %s is still at seq %d after %.0f s, behind event %d; "
                               "loading it anyway", self.worker.worker_id, snapshot.seq,
                               STALE_SNAPSHOT_PATIENCE_SECONDS, self.seen_seq)
                break
            await asyncio.sleep(STALE_SNAPSHOT_RETRY_SECONDS)
        self.index.load_snapshot(self.worker.worker_id, self.worker.incarnation, snapshot_records(snapshot))
        self.last_seq = snapshot.seq
        self.resyncs += 1
        logger.info("index of %s loaded from snapshot at seq %d (%d blocks)", self.worker.worker_id,
                    snapshot.seq, self.index.num_blocks(self.worker.worker_id))

    async def _fetch_snapshot(self) -> wire.KVSnapshot:
        while True:
            try:
                return await self.client.snapshot()
            except WorkerError as error:
                logger.warning("snapshot of %s failed (%s); retrying", self.worker.worker_id, error)
                await asyncio.sleep(1.0)

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            seq, batch = kv_events.decode_frames(frames)
        except kv_events.KVEventDecodeError as error:
            logger.warning("undecodable KV event from %s: %s", self.worker.worker_id, error)
            return
        self.seen_seq = max(self.seen_seq, seq)
        if seq <= self.last_seq:
            return  # already in the snapshot
        if seq != self.last_seq + 1:
            self.gaps += 1
            logger.warning("KV events %d..%d from %s lost; resyncing", self.last_seq + 1, seq - 1,
                           self.worker.worker_id)
            self.last_seq = _NEEDS_RESYNC
            return
        for event in batch.events:
            self.index.apply(self.worker.worker_id, event)
        self.last_seq = seq


_NEEDS_RESYNC = -2


class IndexSync:
    """Starts and stops one ``WorkerIndexSync`` per live worker incarnation."""

    def __init__(self, index: PrefixIndex):
        self.index = index
        self._tasks: dict[str, tuple[WorkerIndexSync, asyncio.Task]] = {}
        self._background: set[asyncio.Task] = set()

    def worker_up(self, worker: WorkerView, client: WorkerClient) -> None:
        self.worker_down(worker.worker_id)
        if not worker.kv_events_address:
            return
        sync = WorkerIndexSync(self.index, worker, client)
        self._tasks[worker.worker_id] = (sync, asyncio.create_task(sync.run()))

    def worker_down(self, worker_id: str) -> None:
        entry = self._tasks.pop(worker_id, None)
        if entry is not None:
            entry[1].cancel()
        self.index.purge(worker_id)

    def worker_left(self, worker_id: str) -> None:
        """The worker left the fleet: its eviction count goes too (a restart keeps it)."""
        self.index.forget(worker_id)

    def request_resync(self, worker_id: str) -> None:
        entry = self._tasks.get(worker_id)
        if entry is not None:
            task = asyncio.create_task(entry[0].resync_now())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def stats(self, worker_id: str) -> tuple[int, int]:
        """(resyncs, gaps) seen for a worker's current incarnation."""
        entry = self._tasks.get(worker_id)
        return (entry[0].resyncs, entry[0].gaps) if entry else (0, 0)

    async def stop(self) -> None:
        tasks = [task for _, task in self._tasks.values()] + list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
