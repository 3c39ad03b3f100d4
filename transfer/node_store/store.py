"""The node store: the index (``transfer.node_store.index``) together with the bytes it
indexes, in host arenas and disk files (``transfer.node_store.blocks``). Each request is
one call; the server (``transfer.node_store.server``) decodes, calls, and replies.

The store adopts the KV layout of its first put and refuses any other: one store serves
the engines of one model and dtype on its host. (Block hashes name tokens and namespace,
not dtype, so two layouts must never share a store.)

A put copies each block it lacks from the writer's staged copy into a host slot and keeps
the xxh3-64 of the slot's bytes. A get pins the blocks (``pin_seconds``), brings disk blocks
back into host slots first, checking their checksums there, and answers where each lies and
its checksum, which the reader checks again after its read: a block changed or cut short
anywhere on its way is refused, never loaded.

Single writer: the server's thread calls every method.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import xxhash

from foundation import wire
from transfer.memfd import SharedMemoryUnavailable, local_host, open_named
from transfer.node_store.blocks import PUT_PREFIX, Arenas, BadLayout, BlockFormat, DiskBlockMissing, DiskTier
from transfer.node_store.index import BlockKey, Demote, Move, Tier, TierIndex
from transfer.node_store.settings import NodeStoreSettings

logger = logging.getLogger("kvroute.node_store")

KEY_BYTES = 16
MAX_KEYS = 4096  # per request: 128k tokens in blocks of 32
DISK_FOLDER = "kvroute-node-store"
T = TypeVar("T")


class RequestRefused(ValueError):
    """A request the store will not serve; ``code`` tells the client what to do."""

    def __init__(self, message: str, code: str = "refused"):
        super().__init__(message)
        self.code = code


def block_checksum(data: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(data))


class NodeStore:
    def __init__(self, settings: NodeStoreSettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.clock = clock
        self.layout: wire.KVLayoutSpec | None = None
        self.format: BlockFormat | None = None
        self.index: TierIndex | None = None
        self.arenas: Arenas | None = None
        self.disk: DiskTier | None = None
        self.counters = wire.TierCounters()

    # ---------------------------------------------------------------- requests

    def lookup(self, request: wire.TierLookup) -> wire.TierLookupReply:
        keys = checked_keys(request.keys)
        found = self.index.leading(keys) if self.index is not None else 0
        self.counters.lookups += 1
        self.counters.lookup_blocks += len(keys)
        self.counters.lookup_hits += found
        return wire.TierLookupReply(num_leading=found)

    def put(self, request: wire.TierPut, frame: memoryview | None) -> wire.TierPutReply:
        keys = checked_keys(request.keys)
        self._adopt(request.layout)
        self.counters.puts += 1
        lacking = [position for position, key in enumerate(keys) if key not in self.index]
        reply = wire.TierPutReply(present=len(keys) - len(lacking))
        if lacking:
            nbytes = len(keys) * self.format.block_bytes
            reply.stored, reply.no_room = self._with_staged(request.copy, frame, nbytes,
                                                            lambda data: self._store(keys, lacking, data))
        self.counters.blocks_stored += reply.stored
        self.counters.blocks_present += reply.present
        return reply

    def get(self, request: wire.TierGet) -> tuple[wire.TierGetReply, list[np.ndarray]]:
        """The reply, and the blocks to send as frames after it (none for a reader on this host)."""
        keys = checked_keys(request.keys)
        self.counters.gets += 1
        try:
            slots = self._pinned_host_slots(request.layout, keys)
        except RequestRefused:
            self.counters.gets_failed += 1
            raise
        self.counters.blocks_served += len(keys)
        checksums = [self.index.entry(key).checksum for key in keys]
        if request.host and request.host == local_host():
            blocks = [wire.TierBlock(*self.arenas.where(slot), checksum) for slot, checksum in zip(slots, checksums)]
            return wire.TierGetReply(arenas=self.arenas.refs(), blocks=blocks), []
        blocks = [wire.TierBlock(-1, 0, checksum) for checksum in checksums]
        return wire.TierGetReply(blocks=blocks), [self.arenas.slot(slot) for slot in slots]

    def events(self, request: wire.TierEventsRequest) -> wire.TierEventsReply:
        """What the store stored and removed since the reader's last event, or all it holds."""
        if self.index is None:  # nothing stored yet; the first put starts the log
            return wire.TierEventsReply(snapshot=True)
        log = self.index.events
        events = log.since(request.epoch, request.since)
        snapshot = events is None
        if snapshot:
            events = self.index.holdings()
        return wire.TierEventsReply(epoch=log.epoch, seq=log.seq, snapshot=snapshot,
                                    events=[wire.TierEvent(e.kind == "stored", Tier(e.tier).value, e.key)
                                            for e in events])

    def stats(self) -> wire.TierStatsReply:
        counters = self.counters
        if self.index is not None:
            counters.host_blocks = self.index.num_blocks(Tier.HOST)
            counters.disk_blocks = self.index.num_blocks(Tier.DISK)
        return wire.TierStatsReply(counters=counters, layout=self.layout)

    def reset(self) -> wire.TierResetReply:
        """Drop every block in every tier; the layout and the arenas stay. A reader still
        copying a dropped block's slot finds its checksum changed once the slot is reused,
        and refuses it."""
        drops = self.index.clear() if self.index is not None else []
        for drop in drops:
            if drop.tier is Tier.DISK:
                self.disk.remove(drop.slot)
        self.counters.resets += 1
        logger.info("reset: %d blocks dropped", len(drops))
        return wire.TierResetReply(blocks_dropped=len(drops))

    def close(self) -> None:
        if self.arenas is not None:
            self.arenas.close()
        if self.disk is not None:
            self.disk.wipe()

    # ---------------------------------------------------------------- layout

    def _adopt(self, layout: wire.KVLayoutSpec) -> None:
        """The first put's layout becomes the store's; any other is refused."""
        if self.layout is not None:
            if layout != self.layout:
                raise RequestRefused(f"this store holds blocks of another KV layout ({self.layout}); "
                                     "one store serves engines of one model and dtype")
            return
        try:
            block_format = BlockFormat.of(layout)
        except BadLayout as error:
            raise RequestRefused(str(error)) from error
        host_slots = self.settings.host_bytes // block_format.block_bytes
        if host_slots < 1:
            raise RequestRefused(f"--host-kv-gib {self.settings.host_kv_gib} holds no block of "
                                 f"{block_format.block_bytes} bytes")
        disk_slots = self.settings.disk_bytes // block_format.block_bytes
        self.index = TierIndex(host_slots, disk_slots)
        self.arenas = Arenas(block_format.block_bytes, host_slots)
        if disk_slots:
            self.disk = DiskTier(Path(self.settings.disk_kv_dir) / DISK_FOLDER, block_format.block_bytes)
        self.layout, self.format = layout, block_format
        self.counters.block_bytes = block_format.block_bytes
        self.counters.host_capacity, self.counters.disk_capacity = host_slots, disk_slots
        logger.info("holding blocks of %d bytes: %d in host memory, %d on disk", block_format.block_bytes,
                    host_slots, disk_slots)

    # ---------------------------------------------------------------- put

    def _with_staged(self, copy: wire.SharedCopyRef | None, frame: memoryview | None, nbytes: int,
                     store: Callable[[np.ndarray], T]) -> T:
        """``store`` applied to the writer's staged blocks: its frame, or its shared copy
        mapped here for the call's length."""
        if copy is None:
            if frame is None or frame.nbytes != nbytes:
                raise RequestRefused(f"a put of these blocks needs a frame of {nbytes} bytes")
            return store(np.frombuffer(frame, dtype=np.uint8))
        mapping = self._map_copy(copy, nbytes)
        try:
            return store(np.frombuffer(mapping, dtype=np.uint8, count=nbytes))
        finally:
            try:
                mapping.close()
            except BufferError:  # a traceback still holds a view; the mapping goes with it
                pass

    @staticmethod
    def _map_copy(copy: wire.SharedCopyRef, nbytes: int) -> mmap.mmap:
        try:
            fd = open_named(copy, PUT_PREFIX)
        except SharedMemoryUnavailable as error:
            raise RequestRefused(str(error), code="copy_unavailable") from error
        try:
            if os.fstat(fd).st_size < nbytes:
                raise RequestRefused(f"the writer's copy holds fewer than {nbytes} bytes")
            return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def _store(self, keys: list[BlockKey], positions: list[int], data: np.ndarray) -> tuple[int, int]:
        """(blocks stored, blocks that found no room)."""
        staged = self.format.staged_blocks(data, len(keys))
        stored = no_room = 0
        now = self.clock()
        for position in positions:
            key = keys[position]
            if key in self.index:  # named twice in this put
                continue
            admission = self.index.admit(key, now)
            if admission is None:
                no_room += 1
                continue
            self._perform(admission.moves)
            slot = self.arenas.slot(admission.slot)
            self.format.slot_rows(slot)[...] = staged[:, :, position, :]
            self.index.set_checksum(key, block_checksum(slot))
            stored += 1
        return stored, no_room

    def _perform(self, moves: tuple[Move, ...]) -> None:
        for move in moves:
            if isinstance(move, Demote):
                try:
                    self.disk.write(move.disk_slot, self.arenas.slot(move.host_slot))
                except OSError as error:  # its read-back will fail its check and be refused
                    logger.warning("demoting a block to disk failed: %s", error)
                self.counters.demotions += 1
            else:
                if move.tier is Tier.DISK:
                    self.disk.remove(move.slot)
                self.counters.dropped += 1

    # ---------------------------------------------------------------- get

    def _pinned_host_slots(self, layout: wire.KVLayoutSpec, keys: list[BlockKey]) -> list[int]:
        """The host slots of ``keys``, every one pinned, disk blocks brought back first."""
        if self.layout is None or layout != self.layout:
            raise RequestRefused("this store holds no blocks of that KV layout")
        entries = [self.index.entry(key) for key in keys]
        if any(entry is None for entry in entries):
            raise RequestRefused("a block asked for is not held (evicted since it was looked up)")
        now = self.clock()
        until = now + self.settings.pin_seconds
        self.index.pin([key for key, entry in zip(keys, entries) if entry.tier is Tier.HOST], until)
        for key, entry in zip(keys, entries):
            if entry.tier is Tier.DISK:
                # Bringing one block back demotes a host block, which on a full disk tier drops
                # the least recently used disk block: possibly another of this very read.
                if self.index.entry(key) is None:
                    raise RequestRefused("a block asked for was dropped to bring another of the same read "
                                         "back from disk: the disk tier is too small for this read")
                self._promote(key, now)
                self.index.pin([key], until)  # before the next promotion could evict it
        return [self.index.entry(key).slot for key in keys]

    def _promote(self, key: BlockKey, now: float) -> None:
        promotion = self.index.promote(key, now)
        if promotion is None:
            raise RequestRefused("no room in host memory to bring a disk block back: every block is pinned")
        self._perform(promotion.moves)
        slot = self.arenas.slot(promotion.host_slot)
        try:
            self.disk.read_into(promotion.disk_slot, slot)
            if block_checksum(slot) != self.index.entry(key).checksum:
                raise DiskBlockMissing("its bytes do not match their checksum")
        except DiskBlockMissing as error:
            self.index.remove(key)
            self.counters.corrupt_blocks += 1
            logger.warning("refused a disk block: %s", error)
            raise RequestRefused(f"a disk block was refused: {error}") from error
        finally:
            self.disk.remove(promotion.disk_slot)
        self.counters.promotions += 1


def checked_keys(keys: list[bytes]) -> list[BlockKey]:
    if len(keys) > MAX_KEYS:
        raise RequestRefused(f"at most {MAX_KEYS} blocks a request, got {len(keys)}")
    if any(len(key) != KEY_BYTES for key in keys):
        raise RequestRefused(f"block keys are {KEY_BYTES} bytes")
    return keys
