"""Which sends of a transfer the link sender tracks, and when their buffers may be reused.

A backend whose messages complete in order (ZeroMQ: one socket, one peer) tracks only a
transfer's last message; the others' buffers stay in flight until it completes. Any other
backend tracks every message. Either way ``send`` returns only once everything left.
"""

from __future__ import annotations

import torch

from tests.send_buffer_fakes import FakeTracker, same_storage
from transfer.transports.base import Sender
from transfer.transports.settings import LinkOptions

FRAME_BYTES = (2 << 20, 2 << 20, 2 << 20)  # above the packing size: one message per frame


class RecordingSender(Sender):
    backend = "recording"

    def __init__(self, completes_in_order: bool):
        super().__init__(LinkOptions(device=torch.device("cpu")))
        self.completes_in_order = completes_in_order
        self.sent: list[tuple[torch.Tensor, FakeTracker | None]] = []

    def _send_header(self, packed: bytes, deadline: float) -> None:
        return None

    def _send_buffer(self, buffer: torch.Tensor, deadline: float, digests: bytes | None) -> FakeTracker:
        tracker = FakeTracker(done=False)
        self.sent.append((buffer, tracker))
        return tracker

    def _send_untracked(self, buffer: torch.Tensor, deadline: float, digests: bytes | None) -> None:
        self.sent.append((buffer, None))

    def _close(self) -> None:
        pass


def send_one(sender: RecordingSender) -> None:
    sender.send(FRAME_BYTES, lambda index, out: out.fill_(index), deadline=float("inf"))


def test_an_in_order_backend_tracks_only_the_last_message_and_waits_for_it_once():
    sender = RecordingSender(completes_in_order=True)
    send_one(sender)
    trackers = [tracker for _, tracker in sender.sent]
    assert trackers[:-1] == [None, None] and trackers[-1] is not None
    assert len(trackers[-1].waits) == 1


def test_untracked_buffers_are_reused_only_after_the_last_message_completed():
    sender = RecordingSender(completes_in_order=True)
    send_one(sender)
    first_buffers = [buffer for buffer, _ in sender.sent]
    last_tracker = sender.sent[-1][1]

    last_tracker.done = False  # as if the last message were still on its way
    taken = [sender._buffers.acquire(FRAME_BYTES[0])[1] for _ in FRAME_BYTES]
    assert not any(same_storage(new, old) for new in taken for old in first_buffers)

    fresh = RecordingSender(completes_in_order=True)
    send_one(fresh)
    reused = [fresh._buffers.acquire(FRAME_BYTES[0])[1] for _ in FRAME_BYTES]
    assert all(any(same_storage(new, old) for old in (b for b, _ in fresh.sent)) for new in reused)


def test_any_other_backend_tracks_and_waits_for_every_message():
    sender = RecordingSender(completes_in_order=False)
    send_one(sender)
    trackers = [tracker for _, tracker in sender.sent]
    assert len(trackers) == len(FRAME_BYTES) and all(tracker is not None for tracker in trackers)
    assert all(len(tracker.waits) == 1 for tracker in trackers)
