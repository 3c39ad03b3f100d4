"""Shortening how long vLLM's model worker busy-waits after each command.

vLLM's model-worker process reads its next command (an engine step, an RPC) from a
shared-memory ring buffer. After every read its main thread spins on that buffer with
``sched_yield`` for a whole second before it falls back to sleeping on a socket
(``shm_broadcast.SpinCondition``, ``busy_loop_s=1``, not configurable). On CPU that second
takes up to a core from whatever shares it, and it is exactly when the block server in
this process sends a freshly leased prompt's blocks: right after the prefill step that
filled them (an 11 MB pull then took 10-13 ms instead of 7-8 ms). While an engine serves,
its next step follows the last within milliseconds, so a window of a few tens of
milliseconds keeps the spin's benefit and ends it soon after the engine goes idle; a
sleeping reader is woken by the writer's notification.
"""

from __future__ import annotations

import gc


def shorten_idle_spin(seconds: float) -> int:
    """Cap the spin window of every shared-memory queue this process reads from at
    ``seconds``; returns how many were shortened (0 without vLLM's queues, or when
    ``seconds`` is negative: leave vLLM's own)."""
    if seconds < 0:
        return 0
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM layout: nothing to shorten
        return 0
    # The queues are made before the connector, and nothing references them from here:
    # find them among the live objects (once, at start-up, ~0.1 s).
    shortened = 0
    for candidate in gc.get_objects():
        # type(), not isinstance(): the latter reads __class__, which wakes lazy module proxies.
        if type(candidate) is SpinCondition and candidate.is_reader and candidate.busy_loop_s > seconds:
            candidate.busy_loop_s = seconds
            shortened += 1
    return shortened
