"""A stand-in for zmq.MessageTracker, and a check that two tensors share storage: for the tests
of the send buffer pool and of the link senders that use it."""

from __future__ import annotations

import torch
import zmq


class FakeTracker:
    """Stands in for zmq.MessageTracker: ``done`` is flipped by the test."""

    def __init__(self, done: bool = False, completes_on_wait: bool = True):
        self.done = done
        self.completes_on_wait = completes_on_wait
        self.waits: list[float] = []

    def wait(self, timeout: float = -1) -> None:
        self.waits.append(timeout)
        if not self.completes_on_wait:
            raise zmq.NotDone()
        self.done = True


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
