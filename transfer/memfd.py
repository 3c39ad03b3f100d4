"""Anonymous shared-memory files (memfds) that another process on this host opens through
``/proc/<pid>/fd/<fd>``: what staged lease copies (``transfer.shared_copies``) and the node
store's arenas (``transfer.node_store``) are made of. Torch-free, so the node store process
needs no torch.

A memfd has no name in any file system, so a process killed with SIGKILL leaves nothing
behind. Its random name, seen in the link of the descriptor a reader opened, proves the
reader holds the file it was told of and not whatever later reused that descriptor number.
"""

from __future__ import annotations

import functools
import mmap
import os
import secrets
import socket
import threading

from foundation.wire import SharedCopyRef

# Linux: memfds, and /proc to reach another process's descriptors. Elsewhere nothing is shared.
SUPPORTED = hasattr(os, "memfd_create") and hasattr(os, "preadv") and os.path.isdir("/proc/self/fd")
MAX_BUFFERS_PER_READ = 1024  # Linux's IOV_MAX


class SharedMemoryUnavailable(RuntimeError):
    """This process cannot read the other's file (another PID namespace, no permission, gone)."""


def host_identity() -> str:
    """Equal for two processes on one running machine with one host name.

    The boot id alone would match containers sharing a kernel but not a file system; the
    host name alone would match two machines named alike. ipc socket files also need a
    directory both ends see, which one host name and one boot usually mean."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot_id = file.read().strip()
    except OSError:
        boot_id = f"pid-namespace-{os.getpid()}"  # unknown boot: only this process matches
    return f"{socket.gethostname()}/{boot_id}"


@functools.cache
def local_host() -> str:
    """Equal for two processes that can open each other's descriptors through /proc: one
    running machine (``host_identity``) and one PID namespace. Empty where memfds are not
    supported: then this process neither offers nor reads them."""
    if not SUPPORTED:
        return ""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""  # no /proc to go through: never offer or accept shared memory
    return f"{host_identity()}/{namespace}"


class MemFile:
    """One memfd, mapped read-write here. ``close`` closes the descriptor; the mapping (and
    so the memory) lives on while anything still uses it."""

    def __init__(self, nbytes: int, prefix: str):
        self.name = prefix + secrets.token_hex(16)
        self.nbytes = nbytes
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self.mapping = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self._closed = False
        self._lock = threading.Lock()

    def ref(self, num_blocks: int) -> SharedCopyRef:
        return SharedCopyRef(pid=os.getpid(), fd=self.fd, name=self.name, num_blocks=num_blocks)

    def close(self) -> None:
        """Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.close(self.fd)

    @property
    def closed(self) -> bool:
        return self._closed


def open_named(ref: SharedCopyRef, prefix: str, flags: int = os.O_RDONLY) -> int:
    """A descriptor of another process's memfd, checked to be the one ``ref`` names; the
    caller closes it. Raises SharedMemoryUnavailable otherwise."""
    try:
        fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", flags | os.O_CLOEXEC)
    except OSError as error:
        raise SharedMemoryUnavailable(f"cannot open the shared file: {error}") from error
    try:
        # Checked on the descriptor we hold, so the answer cannot change under us.
        target = os.readlink(f"/proc/self/fd/{fd}")
        if not ref.name.startswith(prefix) or target != f"/memfd:{ref.name} (deleted)":
            raise SharedMemoryUnavailable(f"descriptor {ref.fd} of process {ref.pid} is {target!r}, "
                                          f"not the copy {ref.name!r} (its owner has closed it)")
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_fully(fd: int, rows: list[memoryview], offset: int) -> int:
    """``preadv`` of consecutive bytes from ``offset`` into ``rows``; raises
    SharedMemoryUnavailable on a short read."""
    expected = sum(row.nbytes for row in rows)
    read = 0
    for start in range(0, len(rows), MAX_BUFFERS_PER_READ):
        batch = rows[start:start + MAX_BUFFERS_PER_READ]
        got = os.preadv(fd, batch, offset + read)
        read += got
        if got != sum(row.nbytes for row in batch):
            raise SharedMemoryUnavailable(f"short read from the shared file: {read} of {expected} bytes")
    return read
