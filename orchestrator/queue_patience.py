"""Waiting out a busy worker's queue without mistaking it for a failed worker.

Every wait for a worker's next token has a timeout (the worker timeout, 60 s), because
ZeroMQ never reports a dead peer. Under overload a prompt can wait longer than that in
the queue of a worker that is healthy, only busy. Failing the request then turns a slow
queue into errors: the timeout counts against the worker's circuit breaker (enough of
them take every worker out of rotation, and requests get 503 instead of a place in a
queue), and the request moves to another worker, to the back of another queue.

So when a wait times out, the worker's latest heartbeat decides::

    live, still lists the request as queued (accepted, no output yet),
    and its engine ended a step within the timeout   ──▶ keep waiting
    otherwise (silent, restarted, lost the request,
    or an engine that stopped stepping)              ──▶ the timeout stands

A request may wait so for its first token at most ``limit_seconds`` in all; past that
it fails with ``queue_timeout``, which is not held against the worker: it was working.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.registry import WorkerView
from orchestrator.worker_client import WorkerError, WorkerTimeout

logger = logging.getLogger("kvroute.orchestrator.patience")

QUEUE_TIMEOUT_CODE = "queue_timeout"


class QueueTimeout(WorkerError):
    """A request waited the queue-wait limit for its first token on a worker that was
    working through its queue all along."""

    def __init__(self, message: str):
        super().__init__(QUEUE_TIMEOUT_CODE, message)


def working_through_queue(view: WorkerView | None, request_id: str, asked_at: float, now: float,
                          heartbeat_timeout: float, step_timeout: float) -> bool:
    """Whether ``view`` (the worker's latest heartbeat, None once it is dropped) shows a
    live worker that still holds ``request_id`` unanswered and whose engine is stepping.
    ``asked_at``: when the wait began; a heartbeat from before then may not list the
    request yet, so its absence there says nothing."""
    if view is None or now - view.last_seen > heartbeat_timeout:
        return False
    queued = view.load.queued_prefill
    if queued is None:  # a worker that does not list its queue
        return False
    if request_id not in queued and view.last_seen > asked_at:  # lost (restarted, or answered and lost)
        return False
    # The oldest queued prompt's time since the engine last ended a step (or since it was
    # accepted): it only grows on an engine that stopped stepping.
    return view.load.head_prompt_age < step_timeout


@dataclass
class QueuePatience:
    """The timeout handler of one request's wait on one worker: ``on_timeout`` returns to
    keep waiting and raises to give up."""

    lookup: Callable[[str], WorkerView | None]  # the registry's latest view of a worker
    worker_id: str
    request_id: str
    heartbeat_timeout: float
    step_timeout: float  # the wait that just timed out
    limit_seconds: float
    clock: Callable[[], float] = time.monotonic
    waiting_since: float | None = None  # set at the first timeout: one whole wait before it

    def on_timeout(self, error: WorkerTimeout) -> None:
        now = self.clock()
        if self.waiting_since is None:
            self.waiting_since = now - self.step_timeout
        if not working_through_queue(self.lookup(self.worker_id), self.request_id, self.waiting_since, now,
                                     self.heartbeat_timeout, self.step_timeout):
            raise error
        waited = now - self.waiting_since
        if waited >= self.limit_seconds:
            raise QueueTimeout(f"{self.request_id} waited {waited:.0f} s in the queue of {self.worker_id} "
                               f"(the queue-wait limit is {self.limit_seconds:.0f} s)")
        logger.info("request %s: no first token from %s after %.0f s; it is still queued there and the "
                    "worker is working, so the request keeps its place", self.request_id, self.worker_id, waited)
