"""The engine's side of the node store's bytes: staging the blocks a connector writes
through, and reading the blocks it loads back straight into its cache rows.

Writing: the blocks are gathered out of the paged cache into a memfd of the connector's
own (``TierCopy``, wire format as a staged lease) on the engine's thread, before the
step that could reuse them; the store then copies what it lacks from there. Reading: a
store on this host answers a get with its arenas, which are opened through /proc and read
with one ``preadv`` per block into that block's rows; otherwise each block comes as a
frame. Either way every block is checked against the checksum the store kept before the
load counts: a block changed or cut short is refused (``TierBlockRefused``), and the
request is recomputed.
"""

from __future__ import annotations

import os
import threading

import torch
import xxhash

from foundation import wire
from transfer.kv_layout import PagedKVCache, block_index_tensor
from transfer.memfd import MemFile, SharedMemoryUnavailable, open_named, read_fully
from transfer.node_store.blocks import ARENA_PREFIX, PUT_PREFIX


class TierBlockRefused(RuntimeError):
    """A block from the store that this cache will not take; nothing counts as loaded."""


class TierCopy(MemFile):
    """Blocks staged for a put, in shared memory the store on this host reads directly."""

    def __init__(self, nbytes: int):
        super().__init__(nbytes, PUT_PREFIX)

    def tensor(self) -> torch.Tensor:
        return torch.frombuffer(self.mapping, dtype=torch.uint8)


def stage_for_put(cache: PagedKVCache, block_ids: list[int], copy: TierCopy | None = None) -> TierCopy:
    """The given blocks gathered out of the cache, for ``NodeStoreClient.put``, at the start
    of ``copy`` (default: a new one, which the caller closes once the store answered)."""
    nbytes = len(block_ids) * cache.spec.bytes_per_block
    fresh = copy is None
    copy = TierCopy(nbytes) if fresh else copy
    try:
        cache.copy_blocks(block_index_tensor(block_ids), into=copy.tensor()[:nbytes])
    except BaseException:
        if fresh:
            copy.close()
        raise
    return copy


class StagingPool:
    """Staging copies kept for the next write-through. A new memfd costs its page faults on
    the engine's thread: 12 MB (8 blocks of SmolLM2 in float32) took 8.5 ms into a new one
    and 2 ms into one already written. At most ``max_idle_bytes`` are kept. Thread-safe."""

    def __init__(self, max_idle_bytes: int = 256 << 20):
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[TierCopy] = []
        self._lock = threading.Lock()

    def stage(self, cache: PagedKVCache, block_ids: list[int]) -> TierCopy:
        nbytes = len(block_ids) * cache.spec.bytes_per_block
        with self._lock:
            fitting = [copy for copy in self._idle if copy.nbytes >= nbytes]
            copy = min(fitting, key=lambda c: c.nbytes) if fitting else None
            if copy is not None:
                self._idle.remove(copy)
        copy = copy or TierCopy(nbytes)
        try:
            return stage_for_put(cache, block_ids, copy)
        except BaseException:
            copy.close()
            raise

    def give_back(self, copy: TierCopy) -> None:
        """A copy the store has finished reading (it answered the put)."""
        with self._lock:
            self._idle.append(copy)
            self._idle.sort(key=lambda c: c.nbytes, reverse=True)  # the largest stay
            while sum(c.nbytes for c in self._idle) > self.max_idle_bytes:
                self._idle.pop().close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for copy in idle:
            copy.close()


def read_blocks(reply: wire.TierGetReply, frames: list, cache: PagedKVCache, local_block_ids: list[int]) -> int:
    """Write the blocks of a get's answer into ``local_block_ids``; returns the bytes read.
    Raises TierBlockRefused when the answer does not fit or a block fails its checksum
    (the target blocks may then hold part of it: the load must count as failed)."""
    if len(reply.blocks) != len(local_block_ids):
        raise TierBlockRefused(f"the store answered {len(reply.blocks)} blocks for {len(local_block_ids)}")
    if reply.arenas:
        return _read_from_arenas(reply, cache, local_block_ids)
    return _read_from_frames(reply, frames, cache, local_block_ids)


def _read_from_arenas(reply: wire.TierGetReply, cache: PagedKVCache, local_block_ids: list[int]) -> int:
    block_bytes = cache.spec.bytes_per_block
    descriptors: dict[int, int] = {}
    try:
        for block, local_id in zip(reply.blocks, local_block_ids):
            fd = descriptors.get(block.arena)
            if fd is None:
                fd = descriptors[block.arena] = _open_arena(reply.arenas, block, block_bytes)
            rows = cache.block_rows(local_id)
            try:
                read_fully(fd, rows, block.offset)
            except SharedMemoryUnavailable as error:
                raise TierBlockRefused(str(error)) from error
            _check(rows, block.checksum)
    finally:
        for fd in descriptors.values():
            os.close(fd)
    return len(local_block_ids) * block_bytes


def _open_arena(arenas: list[wire.SharedCopyRef], block: wire.TierBlock, block_bytes: int) -> int:
    if not 0 <= block.arena < len(arenas):
        raise TierBlockRefused(f"the store named arena {block.arena} of {len(arenas)}")
    arena = arenas[block.arena]
    if block.offset % block_bytes or not 0 <= block.offset <= (arena.num_blocks - 1) * block_bytes:
        raise TierBlockRefused(f"offset {block.offset} is no slot of an arena of {arena.num_blocks} blocks")
    try:
        return open_named(arena, ARENA_PREFIX)
    except SharedMemoryUnavailable as error:
        raise TierBlockRefused(f"cannot open the store's arena: {error}") from error


def _read_from_frames(reply: wire.TierGetReply, frames: list, cache: PagedKVCache, local_block_ids: list[int]) -> int:
    block_bytes = cache.spec.bytes_per_block
    if len(frames) != len(local_block_ids):
        raise TierBlockRefused(f"{len(frames)} frames came for {len(local_block_ids)} blocks")
    for block, frame, local_id in zip(reply.blocks, frames, local_block_ids):
        data = memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")
        if data.nbytes != block_bytes or xxhash.xxh3_64_intdigest(data) != block.checksum:
            raise TierBlockRefused("a block's frame does not match its size or checksum")
        offset = 0
        for row in cache.block_rows(local_id):
            row[:] = data[offset:offset + row.nbytes]
            offset += row.nbytes
    return len(local_block_ids) * block_bytes


def _check(rows: list[memoryview], checksum: int) -> None:
    digest = xxhash.xxh3_64()
    for row in rows:
        digest.update(row)
    if digest.intdigest() != checksum:
        raise TierBlockRefused("a block's bytes do not match the checksum the store kept")
