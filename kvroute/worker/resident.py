"""The worker's own view of its engine's prefix cache, kept from its KV events.

vLLM's replay buffer is short and its sequence numbers restart with each process, so
replay alone cannot rebuild an orchestrator's index. The worker therefore follows its
own engine's event stream and serves a snapshot stamped with the last sequence number
it applied; an orchestrator loads the snapshot and applies the events after it.
"""

from __future__ import annotations

import logging

import zmq

from kvroute import kv_events, wire
from kvroute.netutil import async_context

logger = logging.getLogger("kvroute.worker.resident")


class ResidentBlocks:
    """Single writer: the ``follow`` task. Insertion order keeps parents before children."""

    def __init__(self):
        self.blocks: dict[kv_events.EngineHash, wire.ResidentBlock] = {}
        self.seq = -1
        self.block_size = 0

    def apply(self, seq: int, batch: kv_events.KVEventBatch) -> None:
        if self.seq >= 0 and seq != self.seq + 1:
            logger.error("missed KV events %d..%d from the local engine; snapshots may be incomplete",
                         self.seq + 1, seq - 1)
        for event in batch.events:
            if isinstance(event, kv_events.BlockStored):
                self.block_size = event.block_size
                for record in kv_events.stored_blocks(event):
                    self.blocks[record.engine_hash] = wire.ResidentBlock(
                        record.engine_hash, record.parent, list(record.token_ids),
                        list(record.extra_keys) if record.extra_keys else None)
            elif isinstance(event, kv_events.BlockRemoved):
                for engine_hash in event.block_hashes:
                    self.blocks.pop(engine_hash, None)
            else:
                self.blocks.clear()
        self.seq = seq

    def clear(self) -> None:
        """The engine emptied its prefix cache. vLLM queues the matching AllBlocksCleared
        event but publishes it only at its next step, which an idle engine does not take:
        until then a snapshot would still list every block it dropped. The event, when it
        comes, clears again; the sequence number stays that of the last event applied."""
        self.blocks.clear()

    def snapshot(self, request_id: str, incarnation: str) -> wire.KVSnapshot:
        return wire.KVSnapshot(request_id=request_id, incarnation=incarnation, seq=self.seq,
                               block_size=self.block_size, blocks=list(self.blocks.values()))


async def follow(resident: ResidentBlocks, events_address: str, topic: str) -> None:
    """Apply the engine's published KV events to ``resident`` until cancelled."""
    socket = async_context().socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 0)  # never drop: a dropped batch would corrupt snapshots
    socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
    socket.connect(events_address)
    try:
        while True:
            frames = await socket.recv_multipart()
            try:
                seq, batch = kv_events.decode_frames(frames)
            except kv_events.KVEventDecodeError as error:
                logger.warning("undecodable KV event: %s", error)
                continue
            resident.apply(seq, batch)
    finally:
        socket.close(linger=0)
