"""Reusable send buffers that are never rewritten while a zero-copy send is in flight.

pyzmq's ``copy=False`` hands libzmq a pointer to our memory; the bytes leave later,
on libzmq's I/O thread. Writing into that buffer before the send completes corrupts
the frame on the wire. Each buffer therefore carries the ``MessageTracker`` of its
last send and is handed out again only once that tracker reports done. Reuse avoids
the page faults of fresh allocations, which otherwise dominate large transfers.
"""

from __future__ import annotations

import torch
import zmq

# Below this size pyzmq's own advice holds: copying is cheaper than tracking.
ZERO_COPY_MIN_BYTES = 64 * 1024


class SendBufferPool:
    """Owned by one sending thread (the block server); not thread-safe by design."""

    def __init__(self, max_buffers: int = 96, wait_seconds: float = 30.0):
        self._buffers: list[torch.Tensor] = []
        self._trackers: list[zmq.MessageTracker | None] = []
        self._max_buffers = max_buffers
        self._wait_seconds = wait_seconds

    def acquire(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A free buffer of at least ``nbytes`` (its slot and a view of exactly nbytes)."""
        slot = self._find_free(nbytes)
        if slot is None:
            slot = self._allocate(nbytes)
        self._trackers[slot] = None
        return slot, self._buffers[slot][:nbytes]

    def mark_sent(self, slot: int, tracker: zmq.MessageTracker | None) -> None:
        self._trackers[slot] = tracker

    def num_in_flight(self) -> int:
        return sum(1 for t in self._trackers if t is not None and not t.done)

    def _find_free(self, nbytes: int) -> int | None:
        best = None
        for slot, buffer in enumerate(self._buffers):
            tracker = self._trackers[slot]
            if buffer.numel() >= nbytes and (tracker is None or tracker.done):
                if best is None or buffer.numel() < self._buffers[best].numel():
                    best = slot
        return best

    def _allocate(self, nbytes: int) -> int:
        if len(self._buffers) >= self._max_buffers:
            slot = self._reclaim()
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8)
            return slot
        self._buffers.append(torch.empty(nbytes, dtype=torch.uint8))
        self._trackers.append(None)
        return len(self._buffers) - 1

    def _reclaim(self) -> int:
        """Wait for the smallest buffer's send to finish, then give its slot away."""
        slot = min(range(len(self._buffers)), key=lambda s: self._buffers[s].numel())
        tracker = self._trackers[slot]
        if tracker is not None and not tracker.done:
            tracker.wait(self._wait_seconds)
        return slot


def send_frame(socket: zmq.Socket, prefix: list[bytes], payload: torch.Tensor) -> zmq.MessageTracker | None:
    """Send ``prefix`` frames then ``payload``; zero-copy (tracked) when it is large."""
    view = memoryview(payload.numpy())
    if payload.numel() < ZERO_COPY_MIN_BYTES:
        socket.send_multipart([*prefix, view], copy=True)
        return None
    return socket.send_multipart([*prefix, view], copy=False, track=True)
