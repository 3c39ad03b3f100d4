"""SendBufferPool: a buffer is never handed out again while a zero-copy send of it is
in flight; finished buffers are reused, storage and all. With fake trackers; the pool and
send_frame over real sockets are in tests/contract/test_send_buffers_sockets.py."""

from __future__ import annotations

import pytest
import torch
import zmq

from tests.send_buffer_fakes import FakeTracker, same_storage
from transfer.send_buffers import SendBufferPool


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
