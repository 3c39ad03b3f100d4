"""Graceful drain: a worker told to stop (SIGTERM) takes no new work and finishes what it has.

Here the drain's phases, with fakes (no socket, no process). The heartbeat, the fleet and the
RPC server over real sockets are in tests/contract/test_worker_drain_rpc.py; the launcher's
signals and a whole stack with synthetic workers in tests/integration/test_worker_drain_stack.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from types import SimpleNamespace

import pytest

from tests.drain_fakes import FakeHeartbeats, FakeLeases, FakeServer
from worker.drain import Drain, StopSignals, serve_until_stopped


def drain_of(server: FakeServer, seconds: float = 30.0, leases: FakeLeases | None = None) -> Drain:
    leases = leases or FakeLeases(settles_after=1)
    return Drain(server, FakeHeartbeats(), seconds, leases.settled, leases.release)


async def test_an_idle_worker_drains_at_once_and_says_so():
    server, leases = FakeServer(running=0), FakeLeases(settles_after=1)
    drain = drain_of(server, leases=leases)
    started = time.monotonic()
    await asyncio.wait_for(drain.run(asyncio.Event(), []), 1)
    assert time.monotonic() - started < 0.5
    assert server.draining and drain.heartbeats.beats_now == 1
    assert leases.releases == 0


async def test_drain_waits_for_running_requests():
    server, leases = FakeServer(running=2), FakeLeases(settles_after=1)
    running = asyncio.create_task(drain_of(server, leases=leases).run(asyncio.Event(), []))
    await asyncio.sleep(0.2)
    assert not running.done()
    server.finish_all()
    await asyncio.wait_for(running, 1)
    assert leases.releases == 0


async def test_drain_waits_for_held_leases_after_the_last_request():
    leases = FakeLeases(settles_after=3)
    await asyncio.wait_for(drain_of(FakeServer(running=0), leases=leases).run(asyncio.Event(), []), 2)
    assert leases.checks == 3 and leases.releases == 0


async def test_drain_deadline_stops_the_wait_and_releases_the_leases():
    leases = FakeLeases(settles_after=None)
    started = time.monotonic()
    await asyncio.wait_for(drain_of(FakeServer(running=1), seconds=0.2, leases=leases).run(asyncio.Event(), []), 2)
    assert 0.2 <= time.monotonic() - started < 1
    assert leases.releases == 1


async def test_a_stop_during_the_drain_ends_it_at_once():
    leases, stop = FakeLeases(settles_after=None), asyncio.Event()
    running = asyncio.create_task(drain_of(FakeServer(running=1), leases=leases).run(stop, []))
    await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(running, 0.5)
    assert leases.releases == 1


async def test_serve_until_stopped_cancels_the_serving_tasks_on_stop():
    signals = SimpleNamespace(drain=asyncio.Event(), stop=asyncio.Event())
    serving = [asyncio.create_task(asyncio.sleep(3600))]
    signals.stop.set()
    await asyncio.wait_for(serve_until_stopped(serving, signals, drain_of(FakeServer(running=1))), 1)
    assert serving[0].cancelled()


async def test_serve_until_stopped_raises_when_a_serving_task_dies():
    async def broken():
        raise OSError("socket gone")

    signals = SimpleNamespace(drain=asyncio.Event(), stop=asyncio.Event())
    with pytest.raises(RuntimeError, match="broken ended unexpectedly"):
        await asyncio.wait_for(serve_until_stopped([asyncio.create_task(broken())], signals,
                                                   drain_of(FakeServer(running=0))), 1)


async def test_sigterm_asks_for_a_drain_and_a_second_one_or_sigint_for_a_stop():
    loop = asyncio.get_running_loop()
    try:
        signals = StopSignals()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(signals.drain.wait(), 1)
        assert not signals.stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(signals.stop.wait(), 1)

        interrupted = StopSignals()  # Ctrl-C stops without a drain
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(interrupted.stop.wait(), 1)
        assert not interrupted.drain.is_set()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
