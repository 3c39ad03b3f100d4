"""SendBufferPool and send_frame over real ZeroMQ sockets (inproc and tcp): small payloads are
copied, large ones go zero-copy and tracked, and a buffer still read by the receiver is never
handed out again."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch
import zmq

from foundation.netutil import free_port, tcp
from tests.send_buffer_fakes import same_storage
from transfer.send_buffers import ZERO_COPY_MIN_BYTES, SendBufferPool, send_frame


@contextlib.contextmanager
def inproc_pair(context: zmq.Context, name: str):
    """A connected (PUSH sender, PULL receiver) over inproc, closed afterwards."""
    receiver = context.socket(zmq.PULL)
    receiver.bind(f"inproc://{name}")
    sender = context.socket(zmq.PUSH)
    sender.connect(f"inproc://{name}")
    try:
        yield sender, receiver
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)


def test_send_frame_copies_small_payloads_and_tracks_large_ones(context):
    with inproc_pair(context, "send-frame-threshold") as (sender, receiver):
        small = torch.full((ZERO_COPY_MIN_BYTES - 1,), 3, dtype=torch.uint8)
        assert send_frame(sender, [b"s"], small) is None
        large = torch.full((ZERO_COPY_MIN_BYTES,), 4, dtype=torch.uint8)
        tracker = send_frame(sender, [b"l"], large)
        assert isinstance(tracker, zmq.MessageTracker)
        assert receiver.recv_multipart() == [b"s", bytes(small.numpy())]
        assert receiver.recv_multipart() == [b"l", bytes(large.numpy())]
        tracker.wait(5)
        assert tracker.done


def test_an_untracked_zero_copy_send_keeps_its_memory_alive_until_libzmq_lets_go(context):
    """A staged lease's runs go out untracked: nothing reuses them, and the frame must still
    read the bytes after the sender dropped every reference of its own."""
    with inproc_pair(context, "send-frame-untracked") as (sender, receiver):
        payload = torch.full((4 * ZERO_COPY_MIN_BYTES,), 7, dtype=torch.uint8)
        assert send_frame(sender, [], payload, track=False) is None
        del payload
        frame = receiver.recv(copy=False)
        assert np.all(np.frombuffer(frame.buffer, dtype=np.uint8) == 7)


@pytest.mark.timeout(30)
def test_pool_honours_a_real_tracker(context):
    """Over inproc, a received zero-copy frame still points at our buffer until the
    receiver drops it: the pool must not hand that buffer out meanwhile."""
    pool = SendBufferPool()
    nbytes = 4 * ZERO_COPY_MIN_BYTES
    with inproc_pair(context, "send-buffer-tracker") as (sender, receiver):
        slot, buffer = pool.acquire(nbytes)
        buffer.fill_(0xAB)
        tracker = send_frame(sender, [], buffer)
        pool.mark_sent(slot, tracker)
        frame = receiver.recv(copy=False)
        assert not tracker.done
        other_slot, other = pool.acquire(nbytes)
        assert other_slot != slot and not same_storage(other, buffer)
        other.fill_(0)
        pool.mark_sent(other_slot, None)
        assert np.all(np.frombuffer(frame.buffer, dtype=np.uint8) == 0xAB)
        del frame
        tracker.wait(5)
        again_slot, again = pool.acquire(nbytes)
        assert again_slot in (slot, other_slot)
        assert pool.num_in_flight() == 0


def _sizes():
    return [ZERO_COPY_MIN_BYTES, 100_000, 300_000, 4_096, 160_000]


def _fill(buffer: torch.Tensor, sequence: int) -> None:
    buffer.fill_(sequence % 251)
    buffer[:8] = torch.frombuffer(bytearray(sequence.to_bytes(8, "little")), dtype=torch.uint8)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_hammered_pool_sends_intact_frames(context, transport):
    """Many zero-copy sends from a small pool: every frame arrives as it was written."""
    if transport == "tcp":
        address = tcp("127.0.0.1", free_port())
        bind_address = address
    else:
        address = bind_address = "inproc://send-buffer-hammer"
    num_frames = 400
    receiver = context.socket(zmq.PULL)
    receiver.setsockopt(zmq.RCVHWM, 4)
    receiver.bind(bind_address)
    sender = context.socket(zmq.PUSH)
    sender.setsockopt(zmq.SNDHWM, 4)
    sender.connect(address)
    pool = SendBufferPool(max_buffers=6, wait_seconds=20)
    problems: list[str] = []
    received: list[int] = []

    def receive():
        for _ in range(num_frames):
            if not receiver.poll(20_000):
                problems.append("receiver timed out")
                return
            header, frame = receiver.recv_multipart(copy=False)
            sequence = int.from_bytes(header.bytes, "little")
            data = np.frombuffer(frame.buffer, dtype=np.uint8)
            size = _sizes()[sequence % len(_sizes())]
            if len(data) != size:
                problems.append(f"frame {sequence}: {len(data)} bytes, expected {size}")
            elif int.from_bytes(data[:8].tobytes(), "little") != sequence:
                problems.append(f"frame {sequence}: header overwritten")
            elif not np.all(data[8:] == sequence % 251):
                problems.append(f"frame {sequence}: payload overwritten")
            received.append(sequence)
            del data, frame

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        for sequence in range(num_frames):
            nbytes = _sizes()[sequence % len(_sizes())]
            slot, buffer = pool.acquire(nbytes)
            _fill(buffer, sequence)
            pool.mark_sent(slot, send_frame(sender, [sequence.to_bytes(8, "little")], buffer))
        thread.join(timeout=40)
    finally:
        sender.close(linger=0)
        receiver_alive = thread.is_alive()
        thread.join(timeout=25)
        receiver.close(linger=0)
    assert not receiver_alive
    assert problems == []
    assert received == list(range(num_frames))
    assert len(pool._buffers) <= 6  # the pool stayed bounded, so buffers were reused
