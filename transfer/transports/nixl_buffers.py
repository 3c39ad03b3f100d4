"""Registered memory of nixl links: what a peer READs from and what a READ lands in.

Registration is what lets NIXL move bytes without a copy, and it costs (pinning, UCX
bookkeeping, metadata for the peer), so it happens once per buffer, not per transfer.
Buffers come in powers of two so transfers of varying sizes reuse a few of them, and a
larger transfer replaces a buffer (deregistering the old one) rather than adding one.

After a failure, a peer may still be READing a sender's buffer, and a READ that timed out
may still write into a receiver's: such memory is ``quarantine``d, held for
QUARANTINE_SECONDS before it is freed, so no allocation can reuse it meanwhile.
"""

from __future__ import annotations

import threading
import time

import torch

from transfer.send_buffers import SendBufferPool
from transfer.transports.nixl_agent import Agent

SMALLEST_BUFFER_BYTES = 64 << 10
QUARANTINE_SECONDS = 120.0  # longer than any transfer deadline kvroute sets

_quarantine: list[tuple[float, object]] = []
_quarantine_lock = threading.Lock()


def quarantine(*held: object) -> None:
    """Keep ``held`` alive for QUARANTINE_SECONDS; let go of what was held long enough."""
    now = time.monotonic()
    with _quarantine_lock:
        _quarantine[:] = [(until, item) for until, item in _quarantine if until > now]
        _quarantine.extend((now + QUARANTINE_SECONDS, item) for item in held)


def buffer_bytes(nbytes: int) -> int:
    """A registered buffer's size for a message of ``nbytes``: the next power of two, so
    transfers of varying sizes reuse a few registrations instead of making new ones."""
    return max(SMALLEST_BUFFER_BYTES, 1 << max(nbytes - 1, 0).bit_length())


class RegisteredBuffers(SendBufferPool):
    """Send buffers registered with the sender's agent when made, and deregistered when a
    larger one replaces them; the partial metadata of each new one waits in
    ``take_new_metadata`` for the next Frames notice."""

    def __init__(self, agent: Agent, device: torch.device, max_buffers: int = 96):
        super().__init__(max_buffers=max_buffers, device=device)
        self._agent = agent
        self._registrations: dict[int, object] = {}  # a buffer's address -> its registration
        self._new_metadata: list[bytes] = []

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = super()._new_buffer(buffer_bytes(nbytes))
        registration, metadata = self._agent.register(buffer)
        self._registrations[buffer.data_ptr()] = registration
        self._new_metadata.append(metadata)
        return buffer

    def _retire(self, buffer: torch.Tensor) -> None:
        self._agent.deregister(self._registrations.pop(buffer.data_ptr()))

    def take_new_metadata(self) -> list[bytes]:
        taken, self._new_metadata = self._new_metadata, []
        return taken

    def close(self) -> None:
        """Deregister every buffer; those a peer may still be reading are quarantined."""
        in_flight = [self._buffers[slot] for slot, _ in self._in_flight]
        for registration in self._registrations.values():
            self._agent.deregister(registration)
        self._registrations.clear()
        if in_flight:
            quarantine(*in_flight)


class ReadBuffer:
    """A receiving end's registered buffer, grown (and registered anew) for a larger message."""

    def __init__(self, agent: Agent, device: torch.device):
        self._agent, self._device = agent, device
        self._buffer: torch.Tensor | None = None
        self._registration = None

    def take(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the buffer, for one READ."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self.close()
            self._buffer = torch.empty(buffer_bytes(nbytes), dtype=torch.uint8, device=self._device)
            self._registration, _ = self._agent.register(self._buffer)
        return self._buffer[:nbytes]

    def quarantine(self, *with_it: object) -> None:
        """A READ into the buffer may still be running: hold the buffer, its registration
        (left as it is) and ``with_it``, and let go of them here."""
        quarantine(self._buffer, self._registration, *with_it)
        self._buffer = self._registration = None

    def close(self) -> None:
        if self._registration is not None:
            self._agent.deregister(self._registration)
        self._buffer = self._registration = None
