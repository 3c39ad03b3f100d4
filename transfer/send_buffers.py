"""Reusable send buffers that are never rewritten while a zero-copy send is in flight.

pyzmq's ``copy=False`` hands libzmq a pointer to our memory; the bytes leave later,
on libzmq's I/O thread. Writing into that buffer before the send completes corrupts
the frame on the wire. Each buffer therefore carries the tracker of its last send and
is handed out again only once that tracker reports done. Reuse avoids the page faults
of fresh allocations, which otherwise dominate large transfers.

A buffer is in exactly one place at a time::

    free (by size) ──acquire──▶ handed out ──mark_sent──▶ in flight (send order)
         ▲                                      │ tracker None or done        │
         └──────────────────────────────────────┴───────── tracker done ◀─────┘

so ``acquire`` looks only at the sends still in flight and at a size-ordered free
list, never at every buffer the pool owns.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Protocol

import torch
import zmq

# Below this size pyzmq's own advice holds: copying is cheaper than tracking.
ZERO_COPY_MIN_BYTES = 64 * 1024


class Tracker(Protocol):
    """A send's completion: zmq.MessageTracker has this shape, as does a torch.distributed Work wrapper."""

    @property
    def done(self) -> bool: ...

    def wait(self, timeout: float) -> None: ...


class SendBufferPool:
    """Owned by one sending thread (a block server, a link's sender); not thread-safe by design.

    ``device``: where the buffers live (CUDA for NCCL links); host memory by default."""

    def __init__(self, max_buffers: int = 96, wait_seconds: float = 30.0, device: torch.device | str = "cpu"):
        self._buffers: list[torch.Tensor] = []
        self._free: list[tuple[int, int]] = []  # (size, slot), ascending: bisect finds the best fit
        self._in_flight: deque[tuple[int, Tracker]] = deque()  # (slot, tracker), oldest send first
        self._max_buffers = max_buffers
        self._wait_seconds = wait_seconds
        self.device = torch.device(device)

    def acquire(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A free buffer of at least ``nbytes`` (its slot and a view of exactly nbytes).

        The slot is the caller's until it hands it back with ``mark_sent``."""
        self._collect_finished()
        slot = self._take_free(nbytes)
        if slot is None:
            slot = self._allocate(nbytes)
        return slot, self._buffers[slot][:nbytes]

    def mark_sent(self, slot: int, tracker: Tracker | None) -> None:
        """Hand a slot back; None: the send copied (or is over), so it is free at once."""
        if tracker is None or tracker.done:
            self._release(slot)
        else:
            self._in_flight.append((slot, tracker))

    def num_in_flight(self) -> int:
        return sum(1 for _, tracker in self._in_flight if not tracker.done)

    def _release(self, slot: int) -> None:
        bisect.insort(self._free, (self._buffers[slot].numel(), slot))

    def _collect_finished(self) -> None:
        # Sends on one socket finish in order, so this usually stops at the first entry;
        # any that finished out of order are collected as well.
        still_in_flight = deque()
        for slot, tracker in self._in_flight:
            if tracker.done:
                self._release(slot)
            else:
                still_in_flight.append((slot, tracker))
        self._in_flight = still_in_flight

    def _take_free(self, nbytes: int) -> int | None:
        """The smallest free buffer that fits, off the free list."""
        index = bisect.bisect_left(self._free, (nbytes, -1))
        if index == len(self._free):
            return None
        return self._free.pop(index)[1]

    def _allocate(self, nbytes: int) -> int:
        if len(self._buffers) >= self._max_buffers:
            slot = self._reclaim()
            self._retire(self._buffers[slot])
            self._buffers[slot] = self._new_buffer(nbytes)
            return slot
        self._buffers.append(self._new_buffer(nbytes))
        return len(self._buffers) - 1

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _retire(self, buffer: torch.Tensor) -> None:
        """A buffer that a larger one replaces; a pool whose buffers are registered somewhere
        (``nixl_backend``) deregisters it here."""

    def _reclaim(self) -> int:
        """A slot to give a new, larger buffer: the smallest free one (every free one is too
        small), else the oldest send's, once it finished."""
        if self._free:
            return self._free.pop(0)[1]
        if not self._in_flight:
            raise RuntimeError(f"all {self._max_buffers} send buffers are handed out and none was marked sent")
        slot, tracker = self._in_flight[0]
        tracker.wait(self._wait_seconds)  # raises (zmq.NotDone) when it did not finish in time
        self._in_flight.popleft()
        return slot


def send_frame(socket: zmq.Socket, prefix: list[bytes], payload: torch.Tensor, flags: int = 0,
               track: bool = True) -> zmq.MessageTracker | None:
    """Send ``prefix`` frames then ``payload``; zero-copy when it is large, tracked unless
    ``track`` is False: for memory never written again, whose reference pyzmq holds until
    libzmq lets go, a tracker only costs time (~0.1 ms a send). ``flags``: e.g. zmq.NOBLOCK."""
    view = memoryview(payload.numpy())
    if payload.numel() < ZERO_COPY_MIN_BYTES:
        socket.send_multipart([*prefix, view], flags, copy=True)
        return None
    return socket.send_multipart([*prefix, view], flags, copy=False, track=track)
