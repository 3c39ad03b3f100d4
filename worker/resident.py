"""The worker's own view of its engine's prefix cache, kept from its KV events.

vLLM's replay buffer is short and its sequence numbers restart with each process, so
replay alone cannot rebuild an orchestrator's index. The worker therefore follows its
own engine's event stream and serves a snapshot stamped with the last sequence number
it applied; an orchestrator loads the snapshot and applies the events after it.

The same blocks tell how far a queued prompt is from its first token: vLLM reports a
chunk's full blocks stored when it schedules the chunk, so the prompt's leading resident
blocks are what its prefill will not compute, or has already scheduled
(``cached_prefix_tokens``). Lookups go by (parent, tokens), the chain vLLM hashes, and
at the root by the cache salt too, so no engine hash is ever recomputed here.
"""

from __future__ import annotations

import logging

import zmq

from foundation import kv_events, wire
from foundation.netutil import async_context

logger = logging.getLogger("kvroute.worker.resident")


ChainKey = tuple  # (parent engine hash, tokens) or, for a first block, (None, tokens, cache salt)


def chain_key(block: wire.ResidentBlock) -> ChainKey:
    tokens = tuple(block.token_ids)
    if block.parent is None:
        return None, tokens, kv_events.salt_of(tuple(block.extra_keys) if block.extra_keys else None)
    return block.parent, tokens


class ResidentBlocks:
    """Single writer: the ``follow`` task. Insertion order keeps parents before children."""

    def __init__(self):
        self.blocks: dict[kv_events.EngineHash, wire.ResidentBlock] = {}
        self._by_chain: dict[ChainKey, kv_events.EngineHash] = {}
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
                    self._add(wire.ResidentBlock(record.engine_hash, record.parent, list(record.token_ids),
                                                 list(record.extra_keys) if record.extra_keys else None))
            elif isinstance(event, kv_events.BlockRemoved):
                for engine_hash in event.block_hashes:
                    self._remove(engine_hash)
            else:
                self.clear()
        self.seq = seq

    def _add(self, block: wire.ResidentBlock) -> None:
        known = self.blocks.get(block.engine_hash)
        if known is not None:
            self._unchain(known)
        self.blocks[block.engine_hash] = block  # a known hash keeps its place: parents stay first
        self._by_chain[chain_key(block)] = block.engine_hash

    def _remove(self, engine_hash: kv_events.EngineHash) -> None:
        block = self.blocks.pop(engine_hash, None)
        if block is not None:
            self._unchain(block)

    def _unchain(self, block: wire.ResidentBlock) -> None:
        key = chain_key(block)
        if self._by_chain.get(key) == block.engine_hash:
            del self._by_chain[key]

    def cached_prefix_tokens(self, token_ids: list[int], cache_salt: str | None,
                             progress: PrefixProgress | None = None) -> int:
        """Tokens of ``token_ids``' leading full blocks resident here under ``cache_salt``.

        ``progress`` remembers how far an earlier call got for the same prompt: while the
        block it ended on is still resident, the walk resumes there (a queued prompt is
        asked again at every heartbeat, and only grows)."""
        size = self.block_size
        if size <= 0:
            return 0
        depth, parent = 0, None
        if progress is not None and progress.depth and progress.engine_hash in self.blocks:
            depth, parent = progress.depth, progress.engine_hash
        full_blocks = len(token_ids) // size
        while depth < full_blocks:
            tokens = tuple(token_ids[depth * size:(depth + 1) * size])
            found = self._by_chain.get((None, tokens, cache_salt) if parent is None else (parent, tokens))
            if found is None:
                break
            depth, parent = depth + 1, found
        if progress is not None:
            progress.depth, progress.engine_hash = depth, parent
        return depth * size

    def clear(self) -> None:
        """The engine emptied its prefix cache. vLLM queues the matching AllBlocksCleared
        event but publishes it only at its next step, which an idle engine does not take:
        until then a snapshot would still list every block it dropped. The event, when it
        comes, clears again; the sequence number stays that of the last event applied."""
        self.blocks.clear()
        self._by_chain.clear()

    def snapshot(self, request_id: str, incarnation: str) -> wire.KVSnapshot:
        return wire.KVSnapshot(request_id=request_id, incarnation=incarnation, seq=self.seq,
                               block_size=self.block_size, blocks=list(self.blocks.values()))


class PrefixProgress:
    """Where ``cached_prefix_tokens`` stopped for one prompt: its depth in blocks, and the
    engine hash of the last block it matched."""

    __slots__ = ("depth", "engine_hash")

    def __init__(self):
        self.depth = 0
        self.engine_hash: kv_events.EngineHash | None = None


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
