"""Staged lease copies in shared memory, read straight into a consumer's cache.

A producer stages a lease (see ``transfer.leases``) into one anonymous file (memfd):
every layer's copy in wire format, one layer after another. A consumer on the same host
opens that file through ``/proc/<pid>/fd/<fd>`` and reads each requested run of blocks
with ``preadv`` straight into the destination rows of its paged cache::

    producer (block server)                        consumer (pull thread)
    staging: memfd, gather each layer into it
          ◀──────────── PullBlocks(host=H)         H: this host, as the consumer sees it
    H is ours, the lease has a shared copy:
    PullHeader(shared_copy=pid, fd, name) ──────▶  open /proc/pid/fd/fd, check its name,
                                                   preadv each run into the cache rows
          ◀──────────── ReleaseLease(ack)
    lease ends: close the fd (the memory goes with the last descriptor or mapping)

A producer stages leases into regions of its staging arena first, one memfd for all of them
(``transfer.staging_arena``), and into a memfd of their own when the arena is full. It
offers an arena lease at its ``offset`` in that file, with a ``pin`` that keeps the region
from reuse, and only to a consumer that says it confirms (``PullBlocks.confirms_shared``):
after reading, the consumer sends ``ConfirmRead``
and trusts what it read only if the producer vouches the lease was live throughout, as for a
direct READ (``transfer.direct_exports``). A region's memory outlives its lease, so the
closed-descriptor check above cannot tell a stale read there; the pin and the confirmation do.

One kernel copy per byte, where a ZeroMQ pull makes three memory passes (the send, the
receive into ZeroMQ's buffer, the write into the cache). Anything that keeps the consumer
from reading the copy (another PID namespace, no permission, the lease ended and its
descriptor number now names something else) raises SharedCopyUnavailable, and the pull
asks for frames instead.

Why a memfd: it has no name in any file system, so a producer killed with SIGKILL leaves
nothing behind. Why the name check: a descriptor number is reused once the lease closes
it; the copy's random name, in the link of the descriptor the consumer opened, proves it
is this lease's copy.
"""

from __future__ import annotations

import os

import torch

from foundation.wire import SharedCopyRef
from transfer.kv_layout import PagedKVCache
from transfer.memfd import SUPPORTED, MemFile, SharedMemoryUnavailable, local_host, open_named, read_fully

NAME_PREFIX = "kvroute-lease-"

# Anything that keeps the consumer from reading the copy; the pull then asks for frames.
SharedCopyUnavailable = SharedMemoryUnavailable

__all__ = ["NAME_PREFIX", "SUPPORTED", "SharedCopy", "SharedCopyUnavailable", "local_host", "read_shared_copy",
           "stage_shared"]


class SharedCopy(MemFile):
    """One staged lease's copy in a memfd. The lease that owns it closes it when it ends;
    tensors from ``tensor()`` stay valid after that (they hold the mapping, and the mapping
    a descriptor of its own, which Python's mmap keeps until the last of them is gone)."""

    def __init__(self, nbytes: int):
        super().__init__(nbytes, NAME_PREFIX)

    def tensor(self) -> torch.Tensor:
        """The whole copy as writable bytes, sharing the file's memory."""
        return torch.frombuffer(self.mapping, dtype=torch.uint8)


def stage_shared(cache: PagedKVCache, block_ids: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], SharedCopy]:
    """``cache.copy_blocks`` into a new shared copy: the layers, and the copy that owns them."""
    shared = SharedCopy(len(block_ids) * cache.spec.bytes_per_block)
    try:
        return cache.copy_blocks(block_ids, into=shared.tensor()), shared
    except BaseException:
        shared.close()
        raise


def read_shared_copy(ref: SharedCopyRef, cache: PagedKVCache, local_block_ids: list[int],
                     positions: list[int]) -> int:
    """Copy blocks ``positions`` of the producer's copy into ``local_block_ids`` of ``cache``.

    Returns the bytes read. Raises SharedCopyUnavailable when the copy cannot be opened or
    is not the one named; the cache's target blocks may then hold part of it, and the
    caller writes them again from frames."""
    fd = open_named(ref, NAME_PREFIX)
    try:
        layer_bytes = ref.num_blocks * cache.layer_bytes_per_block
        total = 0
        for layer in range(cache.spec.num_layers):
            for offset, rows in cache.rows_of_runs(layer, local_block_ids, positions, ref.num_blocks):
                total += read_fully(fd, rows, ref.offset + layer * layer_bytes + offset)
        return total
    finally:
        os.close(fd)
