"""Telling a busy worker from a failed one when a wait for a token times out: the
heartbeat test as a table, the handler with a fake clock, and the circuit breaker's view of
its verdicts. The worker client's waits over real sockets are in
tests/contract/test_worker_client.py."""

from __future__ import annotations

import pytest

from foundation import wire
from orchestrator.circuit_breaker import counts_against_worker
from orchestrator.queue_patience import QUEUE_TIMEOUT_CODE, QueuePatience, QueueTimeout, working_through_queue
from orchestrator.registry import WorkerView
from orchestrator.worker_client import WorkerTimeout

HEARTBEAT_TIMEOUT, STEP_TIMEOUT = 10.0, 60.0


QUEUE = {"r1": 500, "r0": 800}  # r1 is the request that waits


def view(queued: dict[str, int] | None = QUEUE, head_age: float = 1.0, last_seen: float = 100.0) -> WorkerView:
    load = wire.WorkerLoad(queued_prefill=queued, head_prompt_age=head_age)
    return WorkerView(worker_id="prefill-0", role="prefill", incarnation="i", rpc_address="tcp://x:1",
                      load=load, last_seen=last_seen)


# (the worker's latest view, whether the request, sent at 40, is still worth waiting for at 105)
CASES = {
    "busy with a queue that holds the request": (view(), True),
    "gone from the registry": (None, False),
    "heartbeats stopped": (view(last_seen=94.0), False),
    "lost the request (restarted, or answered and the answer was lost)": (view(queued={"r0": 800}), False),
    "a worker that does not list its queue": (view(queued=None), False),
    "an engine that stopped stepping": (view(head_age=61.0), False),
    "a step ended just within the timeout": (view(head_age=59.0), True),
}


@pytest.mark.parametrize("latest, keep", CASES.values(), ids=CASES.keys())
def test_working_through_queue(latest, keep):
    assert working_through_queue(latest, "r1", 40.0, 105.0, HEARTBEAT_TIMEOUT, STEP_TIMEOUT) is keep


def test_a_heartbeat_sent_before_the_request_says_nothing_about_it():
    """With waits shorter than the heartbeat interval, the latest heartbeat may predate the
    request: its absence from that listing is not a loss; from a later one it is."""
    before = view(queued={"r0": 800}, head_age=0.2, last_seen=44.0)
    assert working_through_queue(before, "r1", 44.5, 45.5, HEARTBEAT_TIMEOUT, 1.0)
    after = view(queued={"r0": 800}, head_age=0.2, last_seen=45.2)
    assert not working_through_queue(after, "r1", 44.5, 45.5, HEARTBEAT_TIMEOUT, 1.0)


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def patience(latest: dict, clock: Clock, limit: float = 600.0) -> QueuePatience:
    return QueuePatience(lambda worker_id: latest.get(worker_id), "prefill-0", "r1", HEARTBEAT_TIMEOUT,
                         STEP_TIMEOUT, limit, clock)


def test_a_busy_worker_keeps_the_request_until_the_limit():
    clock = Clock(160.0)  # the first timeout: the wait began at 100
    latest = {"prefill-0": view(last_seen=159.0)}
    handler = patience(latest, clock, limit=150.0)
    handler.on_timeout(WorkerTimeout("nothing in 60 s"))  # keeps waiting
    clock.now, latest["prefill-0"] = 220.0, view(last_seen=219.5)
    handler.on_timeout(WorkerTimeout("nothing in 60 s"))  # 120 s waited, below 150
    clock.now, latest["prefill-0"] = 280.0, view(last_seen=279.0)
    with pytest.raises(QueueTimeout, match="waited 180 s in the queue of prefill-0") as raised:
        handler.on_timeout(WorkerTimeout("nothing in 60 s"))
    assert raised.value.code == QUEUE_TIMEOUT_CODE


def test_the_timeout_stands_once_the_worker_stops_working():
    clock = Clock(160.0)
    latest = {"prefill-0": view(last_seen=159.0)}
    handler = patience(latest, clock)
    handler.on_timeout(WorkerTimeout("first"))
    clock.now, latest["prefill-0"] = 220.0, view(head_age=75.0, last_seen=219.0)  # the engine hung
    timeout = WorkerTimeout("second")
    with pytest.raises(WorkerTimeout) as raised:
        handler.on_timeout(timeout)
    assert raised.value is timeout


def test_a_queue_timeout_is_not_held_against_the_worker_but_a_plain_timeout_is():
    assert not counts_against_worker(QueueTimeout("waited 600 s"))
    assert counts_against_worker(WorkerTimeout("sent nothing in 60 s"))
