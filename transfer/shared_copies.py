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

import functools
import mmap
import os
import secrets
import threading

import torch

from foundation.wire import SharedCopyRef
from transfer.kv_layout import PagedKVCache
from transfer.transports.handshake import host_identity

NAME_PREFIX = "kvroute-lease-"
# Linux: memfds, and /proc to reach another process's descriptors. Elsewhere every pull is frames.
SUPPORTED = hasattr(os, "memfd_create") and hasattr(os, "preadv") and os.path.isdir("/proc/self/fd")
MAX_BUFFERS_PER_READ = 1024  # Linux's IOV_MAX


class SharedCopyUnavailable(RuntimeError):
    """This consumer cannot read the producer's shared copy; the layers must come as frames."""


@functools.cache
def local_host() -> str:
    """Equal for two processes that can open each other's descriptors through /proc: one
    running machine (``host_identity``) and one PID namespace. Empty where shared copies
    are not supported: then this process neither offers nor reads them."""
    if not SUPPORTED:
        return ""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""  # no /proc to go through: never offer or accept shared copies
    return f"{host_identity()}/{namespace}"


class SharedCopy:
    """One staged lease's copy in a memfd. The lease that owns it closes it when it ends;
    tensors from ``tensor()`` stay valid after that (they hold the mapping, and the mapping
    a descriptor of its own, which Python's mmap keeps until the last of them is gone)."""

    def __init__(self, nbytes: int):
        self.name = NAME_PREFIX + secrets.token_hex(16)
        self.nbytes = nbytes
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self._mapping = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED,
                                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self._closed = False
        self._lock = threading.Lock()

    def tensor(self) -> torch.Tensor:
        """The whole copy as writable bytes, sharing the file's memory."""
        return torch.frombuffer(self._mapping, dtype=torch.uint8)

    def ref(self, num_blocks: int) -> SharedCopyRef:
        return SharedCopyRef(pid=os.getpid(), fd=self.fd, name=self.name, num_blocks=num_blocks)

    def close(self) -> None:
        """Idempotent: a lease can end on the block server while its staging fails."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.close(self.fd)

    @property
    def closed(self) -> bool:
        return self._closed


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
    fd = _open(ref)
    try:
        layer_bytes = ref.num_blocks * cache.layer_bytes_per_block
        total = 0
        for layer in range(cache.spec.num_layers):
            for offset, rows in cache.rows_of_runs(layer, local_block_ids, positions, ref.num_blocks):
                total += _read_fully(fd, rows, layer * layer_bytes + offset)
        return total
    finally:
        os.close(fd)


def _open(ref: SharedCopyRef) -> int:
    try:
        fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise SharedCopyUnavailable(f"cannot open the producer's copy: {error}") from error
    try:
        # Checked on the descriptor we hold, so the answer cannot change under us.
        target = os.readlink(f"/proc/self/fd/{fd}")
        if not ref.name.startswith(NAME_PREFIX) or target != f"/memfd:{ref.name} (deleted)":
            raise SharedCopyUnavailable(f"descriptor {ref.fd} of process {ref.pid} is {target!r}, "
                                        f"not the copy {ref.name!r} (its lease has ended)")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _read_fully(fd: int, rows: list[memoryview], offset: int) -> int:
    expected = sum(row.nbytes for row in rows)
    read = 0
    for start in range(0, len(rows), MAX_BUFFERS_PER_READ):
        batch = rows[start:start + MAX_BUFFERS_PER_READ]
        got = os.preadv(fd, batch, offset + read)
        read += got
        if got != sum(row.nbytes for row in batch):
            raise SharedCopyUnavailable(f"short read from the producer's copy: {read} of {expected} bytes")
    return read
