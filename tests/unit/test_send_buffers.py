"""SendBufferPool: a buffer is never handed out again while a zero-copy send of it is
in flight; finished buffers are reused, storage and all."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch
import zmq

from foundation.netutil import free_port, tcp
from transfer.send_buffers import ZERO_COPY_MIN_BYTES, SendBufferPool, send_frame


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


def test_acquire_returns_exactly_nbytes_of_uint8():
    pool = SendBufferPool()
    slot, buffer = pool.acquire(1000)
    assert buffer.dtype == torch.uint8
    assert buffer.numel() == 1000 and buffer.is_contiguous()
    assert slot == 0


def test_buffer_in_flight_is_never_handed_out_again():
    pool = SendBufferPool()
    slot, buffer = pool.acquire(4096)
    tracker = FakeTracker(done=False)
    pool.mark_sent(slot, tracker)
    assert pool.num_in_flight() == 1

    others = []
    for size in (4096, 100, 4096, 1):
        other_slot, other = pool.acquire(size)
        assert other_slot != slot
        assert not same_storage(other, buffer)
        pool.mark_sent(other_slot, FakeTracker(done=False))
        others.append(other_slot)
    assert len(set(others)) == len(others)
    assert pool.num_in_flight() == 5
    assert tracker.waits == []  # below max_buffers nobody waits


def test_done_buffer_is_reused_with_the_same_storage():
    pool = SendBufferPool()
    slot, buffer = pool.acquire(4096)
    buffer.fill_(7)
    tracker = FakeTracker(done=False)
    pool.mark_sent(slot, tracker)
    tracker.done = True
    assert pool.num_in_flight() == 0
    again_slot, again = pool.acquire(4096)
    assert again_slot == slot
    assert same_storage(again, buffer)
    assert again.data_ptr() == buffer.data_ptr()


def test_copied_send_buffer_is_reusable_at_once():
    pool = SendBufferPool()
    slot, buffer = pool.acquire(512)
    pool.mark_sent(slot, None)  # send_frame copies small payloads and returns no tracker
    again_slot, again = pool.acquire(512)
    assert again_slot == slot and same_storage(again, buffer)


def test_a_larger_free_buffer_serves_a_smaller_request_best_fit():
    pool = SendBufferPool()
    slots, trackers = {}, []
    for size in (10_000, 3_000, 6_000):
        slot, buffer = pool.acquire(size)
        slots[size] = (slot, buffer)
        trackers.append(FakeTracker(done=False))
        pool.mark_sent(slot, trackers[-1])
    assert sorted(slot for slot, _ in slots.values()) == [0, 1, 2]
    for tracker in trackers:
        tracker.done = True
    slot, buffer = pool.acquire(2_500)
    assert slot == slots[3_000][0]  # the smallest that fits
    assert buffer.numel() == 2_500 and same_storage(buffer, slots[3_000][1])
    pool.mark_sent(slot, FakeTracker(done=False))
    slot, buffer = pool.acquire(2_500)
    assert slot == slots[6_000][0]  # the 3000-byte one is in flight
    pool.mark_sent(slot, FakeTracker(done=False))
    slot, _ = pool.acquire(7_000)
    assert slot == slots[10_000][0]
    pool.mark_sent(slot, FakeTracker(done=False))
    # Everything is in flight: a new buffer is allocated.
    slot, _ = pool.acquire(1)
    assert slot == 3


def test_too_small_free_buffer_is_not_used():
    pool = SendBufferPool()
    slot, _ = pool.acquire(100)
    pool.mark_sent(slot, None)
    big_slot, big = pool.acquire(200)
    assert big_slot != slot and big.numel() == 200


def test_reclaim_at_max_buffers_waits_on_the_tracker():
    pool = SendBufferPool(max_buffers=2, wait_seconds=12.5)
    small_slot, small = pool.acquire(100)
    small.fill_(1)
    small_tracker = FakeTracker(done=False)
    pool.mark_sent(small_slot, small_tracker)
    big_slot, big = pool.acquire(1000)
    big.fill_(2)
    big_tracker = FakeTracker(done=False)
    pool.mark_sent(big_slot, big_tracker)

    slot, fresh = pool.acquire(500)

    # It waited for the smallest buffer's send, with the configured timeout, and only that one.
    assert small_tracker.waits == [12.5]
    assert big_tracker.waits == []
    assert slot == small_slot
    assert fresh.numel() == 500
    # The in-flight buffers were not written to.
    assert not same_storage(fresh, big)
    fresh.fill_(9)
    assert bool((small == 1).all()) and bool((big == 2).all())
    assert pool.num_in_flight() == 1  # the big one is still in flight


def test_reclaim_of_a_done_buffer_does_not_wait():
    pool = SendBufferPool(max_buffers=1)
    slot, _ = pool.acquire(100)
    tracker = FakeTracker(done=True)
    pool.mark_sent(slot, tracker)
    again, buffer = pool.acquire(1000)  # too big for the free buffer, and the pool is full
    assert again == slot and buffer.numel() == 1000
    assert tracker.waits == []


def test_reclaim_that_times_out_hands_out_nothing():
    pool = SendBufferPool(max_buffers=1, wait_seconds=0.01)
    slot, buffer = pool.acquire(100)
    pool.mark_sent(slot, FakeTracker(done=False, completes_on_wait=False))
    with pytest.raises(zmq.NotDone):
        pool.acquire(100)
    assert pool.num_in_flight() == 1


def test_buffers_live_on_the_pool_device():
    # The meta device stands in for CUDA here: the pool must allocate on the device it was
    # given, without the caller entering a device context.
    pool = SendBufferPool(device="meta")
    _, buffer = pool.acquire(4096)
    assert buffer.device.type == "meta" and buffer.numel() == 4096
    assert SendBufferPool().acquire(1)[1].device.type == "cpu"


def test_a_send_finished_out_of_order_frees_its_buffer():
    pool = SendBufferPool()
    first_slot, _ = pool.acquire(1000)
    first = FakeTracker(done=False)
    pool.mark_sent(first_slot, first)
    second_slot, _ = pool.acquire(1000)
    third_slot, _ = pool.acquire(1000)
    second, third = FakeTracker(done=False), FakeTracker(done=False)
    pool.mark_sent(second_slot, second)
    pool.mark_sent(third_slot, third)
    third.done = second.done = True  # both finish while the oldest send is still in flight
    assert pool.num_in_flight() == 1
    reused = {pool.acquire(1000)[0], pool.acquire(1000)[0]}
    assert reused == {second_slot, third_slot}  # the oldest send still holds its buffer
    assert first.waits == []


def test_reclaim_with_every_buffer_handed_out_says_so():
    pool = SendBufferPool(max_buffers=1)
    pool.acquire(100)  # never marked sent
    with pytest.raises(RuntimeError, match="none was marked sent"):
        pool.acquire(100)


# ---------------------------------------------------------------- with real sockets


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
