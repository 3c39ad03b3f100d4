"""ZeroMQ link sends answer by the deadline even when the socket polls writable and then
refuses: a PUSH socket whose only peer went away between the poll and the send."""

from __future__ import annotations

import time

import pytest
import zmq

from transfer.transports.errors import TransportTimeout
from transfer.transports.zmq_backend import send_by_deadline


class LosesItsPeer:
    """Polls writable every time; refuses the first ``refusals`` sends as libzmq does
    (zmq.Again) with no peer left, then takes them."""

    def __init__(self, refusals: float):
        self.refusals = refusals
        self.polls = 0
        self.flags: list[int] = []

    def poll(self, timeout_ms: int, event: int) -> int:
        assert event == zmq.POLLOUT and timeout_ms > 0
        self.polls += 1
        return event

    def send(self, flags: int) -> str:
        self.flags.append(flags)
        if len(self.flags) <= self.refusals:
            raise zmq.Again()
        return "sent"


def test_a_refused_send_polls_again_and_then_goes_out():
    socket = LosesItsPeer(refusals=2)
    assert send_by_deadline(socket, socket.send, time.monotonic() + 5, "the receiver") == "sent"
    assert socket.polls == 2  # tried first, polled after each refusal
    assert socket.flags == [zmq.NOBLOCK] * 3  # never a blocking send


def test_a_send_refused_until_the_deadline_times_out_at_the_deadline():
    socket = LosesItsPeer(refusals=float("inf"))
    started = time.monotonic()
    with pytest.raises(TransportTimeout, match="the receiver"):
        send_by_deadline(socket, socket.send, started + 0.2, "the receiver")
    assert 0.2 <= time.monotonic() - started < 1.0
    assert set(socket.flags) == {zmq.NOBLOCK}
