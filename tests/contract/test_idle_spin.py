"""transfer.idle_spin against vLLM's own shared-memory command queue."""

from __future__ import annotations

import pytest

from transfer.idle_spin import shorten_idle_spin

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")


@pytest.fixture
def command_queue():
    """A writer and its one local reader, as vLLM's executor and model worker hold them."""
    writer = shm_broadcast.MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=2)
    reader = shm_broadcast.MessageQueue.create_from_handle(writer.export_handle(), rank=0)
    yield writer, reader
    reader.shutdown()
    writer.shutdown()


def test_the_reader_spins_for_the_given_window_and_the_writer_is_untouched(command_queue):
    writer, reader = command_queue
    assert reader._spin_condition.busy_loop_s == 1  # vLLM's own window, which this shortens
    assert shorten_idle_spin(0.02) >= 1
    assert reader._spin_condition.busy_loop_s == 0.02
    assert writer._spin_condition.busy_loop_s == 0  # a writer never spins


def test_negative_leaves_vllms_window(command_queue):
    _, reader = command_queue
    assert shorten_idle_spin(-1) == 0
    assert reader._spin_condition.busy_loop_s == 1


def test_a_shorter_window_is_never_lengthened(command_queue):
    _, reader = command_queue
    shorten_idle_spin(0.005)
    shorten_idle_spin(0.5)
    assert reader._spin_condition.busy_loop_s == 0.005
