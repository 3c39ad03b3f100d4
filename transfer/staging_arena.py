"""The staging arena: one block of host memory per producer process that staged leases are
carved out of, so that NIXL registers it once (``transfer.direct_exports``).

Why one arena and not a copy per lease: a consumer's NIXL agent cannot forget one
registration of a peer, so when a new copy was registered where an old, deregistered one
had lain, its READs found the old registration and failed (NIXL_ERR_NOT_FOUND); and a
registration per lease lay on the pull's path. The arena is mapped once and never unmapped
or deregistered, so no address of it is ever registered twice, the producer's metadata
never changes, and a consumer loads it once.

A lease's region goes back to the arena only once nothing can still read it::

    allocate ──▶ LIVE (its lease's copy) ──close: the lease ended──▶ ENDED ──every hold done──▶ free
                   │ hold(h): a pin of a direct READ, the tracker of a zero-copy send

A hold is anything with a ``done`` property; ``collect`` frees ENDED regions whose holds
are all done, and is called by ``allocate`` and by the block server's loop. Regions start
on page boundaries. The memory is one anonymous file (a memfd, ``transfer.memfd``), so that
consumers on this host without NIXL read a lease's region through ``/proc`` as a shared copy
(``Region.shared_ref``), held by a pin as a direct READ is; where memfds are not supported, an
anonymous mapping. Either way pages cost nothing until staged into, and once staged into
they are reused without faulting again.

An arena only NIXL reads (``shareable=False``: its producer forces nixl, so every consumer
READs it) is anonymous memory advised into transparent huge pages where the kernel offers
them, since shared memory files get none unless the host enables them for shmem. A READ
on one host is UCX's cma, a ``process_vm_readv`` that pins the producer's pages as it
copies: from 2 MiB pages it moved 94 MiB in 61 KiB segments in 10.9 ms here, against
19.4 ms from 4 KiB pages and 13.7 ms for ``preadv`` of the same segments from a memfd.

Thread-safe: the engine's thread allocates, the block server's thread (where leases end)
closes and collects.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
from typing import TYPE_CHECKING, Protocol

import msgspec
import torch

from foundation.wire import SharedCopyRef
from transfer.shared_copies import SUPPORTED as SHARED_COPIES_SUPPORTED
from transfer.shared_copies import SharedCopy

if TYPE_CHECKING:
    from transfer.kv_layout import PagedKVCache

ALIGNMENT = 4096


class Hold(Protocol):
    @property
    def done(self) -> bool: ...


class Region:
    """One lease's bytes in the arena; ``tensor`` views them. Freed by the arena, never by its owner."""

    def __init__(self, arena: StagingArena, offset: int, nbytes: int):
        self.arena = arena
        self.offset = offset
        self.nbytes = nbytes
        self.tensor = arena.tensor[offset:offset + nbytes]
        self.ended = False
        self.holds: list[Hold] = []

    def hold(self, hold: Hold) -> None:
        """Keep the region from reuse until ``hold.done``, even after its lease ended."""
        with self.arena.lock:
            self.holds.append(hold)

    def close(self) -> None:
        """The lease ended: the region is freed once its holds are done. Idempotent."""
        self.arena.end(self)

    def shared_ref(self, num_blocks: int, pin: int) -> SharedCopyRef | None:
        """The region as a shared copy of ``num_blocks`` blocks whose read ``pin`` holds; None
        where the arena is no file another process can open."""
        ref = self.arena.file_ref(num_blocks)
        return None if ref is None else msgspec.structs.replace(ref, offset=self.offset, pin=pin)


class StagingArena:
    def __init__(self, nbytes: int, shareable: bool = True):
        """``shareable``: whether consumers on this host may open it as a file (see the module's docstring)."""
        self.nbytes = _aligned(nbytes)
        # Never closed: the arena lives as long as its process, and consumers open its file.
        self._file = SharedCopy(self.nbytes) if shareable and SHARED_COPIES_SUPPORTED else None
        self.huge_pages = not shareable and huge_pages_offered()
        if self._file is not None:
            self._mapping = self._file.mapping
            self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8)
        else:
            self._mapping, self.tensor = _anonymous(self.nbytes, self.huge_pages)
        self.address = self.tensor.data_ptr()
        self.lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, bytes), by offset, never adjacent
        self._ended: list[Region] = []
        self.free_bytes = self.nbytes

    @property
    def shared(self) -> bool:
        """Whether a consumer on this host can open the arena's memory (it is a memfd)."""
        return self._file is not None

    def file_ref(self, num_blocks: int) -> SharedCopyRef | None:
        """The arena's file, for a consumer on this host to open; None without one."""
        return None if self._file is None else self._file.ref(num_blocks)

    def allocate(self, nbytes: int) -> Region | None:
        """A region of at least ``nbytes``; None when no free run is that large (first fit)."""
        size = _aligned(max(nbytes, 1))
        with self.lock:
            self._collect()
            for index, (offset, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[index]
                    else:
                        self._free[index] = (offset + size, length - size)
                    self.free_bytes -= size
                    return Region(self, offset, size)
        return None

    def end(self, region: Region) -> None:
        with self.lock:
            if not region.ended:
                region.ended = True
                self._ended.append(region)
                self._collect()

    def collect(self) -> None:
        """Free the regions whose leases ended and whose holds are all done."""
        with self.lock:
            self._collect()

    def _collect(self) -> None:
        still_held = []
        for region in self._ended:
            region.holds = [hold for hold in region.holds if not hold.done]
            if region.holds:
                still_held.append(region)
            else:
                self._give_back(region.offset, region.nbytes)
        self._ended = still_held

    def _give_back(self, offset: int, size: int) -> None:
        """Insert a free run, merging it with the runs it touches."""
        self.free_bytes += size
        index = bisect.bisect_left(self._free, (offset, 0))
        if index < len(self._free) and offset + size == self._free[index][0]:
            size += self._free.pop(index)[1]
        if index > 0 and sum(self._free[index - 1]) == offset:
            offset, previous = self._free.pop(index - 1)
            size += previous
            index -= 1
        self._free.insert(index, (offset, size))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


HUGE_PAGE_BYTES = 2 << 20
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_offered() -> bool:
    """Whether the kernel gives anonymous memory transparent huge pages when advised to."""
    try:
        with open(THP_SETTING) as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False


def _anonymous(nbytes: int, huge_pages: bool) -> tuple[mmap.mmap, torch.Tensor]:
    """A private anonymous mapping and a view of ``nbytes`` of it; with ``huge_pages``, the
    view starts on a huge page's boundary (one more huge page is mapped for that) and the
    mapping is advised into huge pages."""
    if not (huge_pages and hasattr(mmap, "MADV_HUGEPAGE")):
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return mapping, torch.frombuffer(mapping, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: small pages work the same
        pass
    return mapping, whole[start:start + nbytes]


# Per process and kind (shareable or not), every arena it made, the current one last: none is ever unmapped.
_arenas: dict[tuple[int, bool], list[StagingArena]] = {}
_arenas_lock = threading.Lock()


def staging_arena(nbytes: int, shareable: bool = True) -> StagingArena:
    """This process's arena of that kind, of at least ``nbytes`` (a forked child makes its own).

    A process serves one engine, so one arena; where several producers share a process (the
    tests do) and one asks for more than the arena has, a larger one takes its place for
    new leases. The old one stays mapped, as every arena does until the process ends, so its
    addresses are never registered again."""
    with _arenas_lock:
        arenas = _arenas.setdefault((os.getpid(), shareable), [])
        if not arenas or arenas[-1].nbytes < nbytes:
            arenas.append(StagingArena(nbytes, shareable))
        return arenas[-1]


def stage_in_arena(cache: PagedKVCache, block_ids: torch.Tensor,
                   arena: StagingArena) -> tuple[tuple[torch.Tensor, ...], Region] | None:
    """``cache.copy_blocks`` into a new region of ``arena``: the layers, and the region that
    owns them; None when the arena has no room (it is full of live or still-read leases)."""
    region = arena.allocate(len(block_ids) * cache.spec.bytes_per_block)
    if region is None:
        return None
    try:
        return cache.copy_blocks(block_ids, into=region.tensor), region
    except BaseException:
        region.close()
        raise
