"""CPU lists for the transfer threads, and binding a thread to them (the ZeroMQ context bound to
them is in tests/contract/test_transfer_context.py)."""

from __future__ import annotations

import os
import threading

import pytest

from transfer.affinity import parse_cpus, pin_current_thread, transfer_cpus


@pytest.mark.parametrize("text, expected", [
    ("0", [0]),
    ("0-3,6", [0, 1, 2, 3, 6]),
    (" 2 , 4-5 ", [2, 4, 5]),
    ("", []),
])
def test_parse_cpus(text, expected):
    assert parse_cpus(text) == expected


@pytest.mark.parametrize("text", ["a", "3-1", "-2", "1-x"])
def test_parse_cpus_rejects_nonsense(text):
    with pytest.raises(ValueError):
        parse_cpus(text)


def test_empty_means_every_cpu():
    assert transfer_cpus("") == list(range(os.cpu_count()))
    assert transfer_cpus("1") == [1]


def test_pinning_binds_only_the_calling_thread():
    mine = os.sched_getaffinity(0)
    seen: list[set[int]] = []

    def run():
        pin_current_thread([min(mine)])
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [{min(mine)}]
    assert os.sched_getaffinity(0) == mine
