"""Graceful drain: a worker told to stop (SIGTERM) takes no new work and finishes what it has.

In layers: the drain's phases with fakes (no socket, no process); the heartbeat that
says "draining" at once, and the fleet that then plans around the worker; the real RPC
server with the synthetic engine in this process (refusal, deadline); the launcher's
order of signals; and, through the OpenAI API, real processes: an orchestrator and
synthetic-engine workers (``testing.synthetic_worker``, tokens a pure function of the
context), one of which is sent SIGTERM mid-stream.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import zmq

from foundation import wire
from foundation.launcher import LaunchedWorker, spawn
from foundation.model_prep import resolve_model
from foundation.netutil import async_context, free_port
from orchestrator.admin import describe_workers
from orchestrator.fleet import Fleet
from orchestrator.index import PrefixIndex
from orchestrator.metrics import Metrics
from orchestrator.registry import WorkerRegistry
from orchestrator.worker_client import WorkerClient, WorkerError
from testing.stack import running_synthetic_stack
from testing.synthetic_worker import SyntheticEngine, SyntheticTiming, synthetic_next_token
from tests.cluster import metric_at
from worker.drain import Drain, StopSignals, serve_until_stopped
from worker.heartbeat import HeartbeatSender
from worker.rpc_server import DRAINING, RpcServer


def wait_until(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


# ---------------------------------------------------------------- the drain's phases, with fakes


class FakeServer:
    """What the drain reads of the RPC server: requests running, and when none is."""

    def __init__(self, running: int):
        self.draining = False
        self.num_active_requests = running
        self._idle = asyncio.Event()
        if running == 0:
            self._idle.set()

    def start_draining(self) -> None:
        self.draining = True

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def finish_all(self) -> None:
        self.num_active_requests = 0
        self._idle.set()


class FakeHeartbeats:
    def __init__(self):
        self.beats_now = 0

    def send_now(self) -> None:
        self.beats_now += 1


class FakeLeases:
    """Held until asked ``settles_after`` times (None: never); counts releases."""

    def __init__(self, settles_after: int | None, held: int = 2):
        self.settles_after, self.held = settles_after, held
        self.checks = self.releases = 0

    async def settled(self) -> bool:
        self.checks += 1
        return self.settles_after is not None and self.checks >= self.settles_after

    async def release(self) -> int:
        self.releases += 1
        return self.held


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


# ---------------------------------------------------------------- heartbeat and fleet

FINGERPRINT = "f" * 16


def heartbeat(worker_id: str, draining: bool) -> wire.Heartbeat:
    return wire.Heartbeat(worker_id=worker_id, role="decode", incarnation="i1", rpc_address="tcp://127.0.0.1:1",
                          load=wire.WorkerLoad(block_size=16), sent_at=0.0, model_fingerprint=FINGERPRINT,
                          draining=draining)


async def test_send_now_beats_before_the_interval_is_up():
    orchestrator = async_context().socket(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{free_port()}"
    orchestrator.bind(address)
    draining = False
    sender = HeartbeatSender((address,), lambda now: heartbeat("decode-0", draining))
    beating = asyncio.create_task(sender.run(interval_seconds=3600))
    try:
        _, first = await asyncio.wait_for(orchestrator.recv_multipart(), 5)
        assert not wire.decode(first).draining
        draining = True
        sender.send_now()
        _, second = await asyncio.wait_for(orchestrator.recv_multipart(), 1)
        assert wire.decode(second).draining
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        orchestrator.close(linger=0)


async def test_a_draining_worker_leaves_planning_but_stays_visible():
    fleet = Fleet(WorkerRegistry(FINGERPRINT, heartbeat_timeout=30), f"tcp://127.0.0.1:{free_port()}", "test")
    await fleet.start()
    worker = async_context().socket(zmq.DEALER)
    worker.connect(fleet._bind_address)

    async def beat(draining: bool) -> None:
        await worker.send(wire.encode(heartbeat("decode-0", draining)))
        assert wire.decode(await asyncio.wait_for(worker.recv(), 5)).accepted

    try:
        await beat(draining=False)
        assert [w.worker_id for w in fleet.live("decode")] == ["decode-0"] and fleet.draining("decode") == []
        await beat(draining=True)
        assert fleet.live("decode") == [] and not fleet.can_serve()
        assert [w.worker_id for w in fleet.draining("decode")] == ["decode-0"]
        assert [(row["worker_id"], row["draining"]) for row in describe_workers(fleet, PrefixIndex())] \
            == [("decode-0", True)]
        metrics = Metrics()
        metrics.refresh_fleet(fleet, PrefixIndex())
        assert metrics.registry.get_sample_value("kvroute_workers_draining", {"role": "decode"}) == 1
        assert metrics.registry.get_sample_value("kvroute_workers", {"role": "decode"}) == 0
    finally:
        worker.close(linger=0)
        await fleet.stop()


# ---------------------------------------------------------------- the RPC server, in this process

PROMPT = [11, 12, 13, 14, 15]


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens an unbroken synthetic run generates (see ``synthetic_next_token``)."""
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(synthetic_next_token(context))
    return context[len(prompt):]


def generate(request_id: str, max_tokens: int) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                sampling=wire.SamplingSpec(max_tokens=max_tokens))


@pytest.fixture
async def synthetic_server():
    """A real RPC server over the synthetic engine, its serving task, and a client of it."""

    async def unused(*args):
        raise AssertionError("not asked in these tests")

    address = f"tcp://127.0.0.1:{free_port()}"
    server = RpcServer(SyntheticEngine(SyntheticTiming(token_seconds=0.02), "tcp://127.0.0.1:1"), address,
                       unused, unused, unused, unused)
    serving = asyncio.create_task(server.serve())
    client = WorkerClient(address)
    try:
        yield server, serving, client
    finally:
        await client.close()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


async def test_a_draining_server_refuses_new_requests_and_finishes_the_running_one(synthetic_server):
    server, _, client = synthetic_server
    tokens = []
    async for chunk in client.generate(generate("long", 30), timeout=5):
        tokens += chunk.token_ids
        if len(tokens) == 5:
            server.start_draining()
            with pytest.raises(WorkerError) as refused:
                [_ async for _ in client.generate(generate("late", 4), timeout=5)]
            assert refused.value.code == DRAINING
    assert tokens == reference(PROMPT, 30)
    await asyncio.wait_for(server.wait_idle(), 1)
    assert server.num_active_requests == 0


async def test_at_the_drain_deadline_the_server_stops_and_its_caller_hears_at_once(synthetic_server):
    server, serving, client = synthetic_server
    signals = SimpleNamespace(drain=asyncio.Event(), stop=asyncio.Event())
    stopping = asyncio.create_task(serve_until_stopped([serving], signals, Drain(server, FakeHeartbeats(), 0.3)))
    tokens, started = [], None
    with pytest.raises(WorkerError) as cut:
        async for chunk in client.generate(generate("long", 200), timeout=5):  # 4 s of tokens
            tokens += chunk.token_ids
            if len(tokens) == 3:
                signals.drain.set()
                started = time.monotonic()
    await asyncio.wait_for(stopping, 1)
    assert time.monotonic() - started < 1.5
    assert cut.value.code == "worker_disconnected"  # the orchestrator moves such a request elsewhere
    assert 3 <= len(tokens) < 200


# ---------------------------------------------------------------- the launcher's stop, with real processes

# A worker process and, in its process group, a child standing in for vLLM's engine
# processes; each logs the SIGTERM it gets. The worker takes a moment to "drain".
WORKER_AND_ENGINE = r"""
log=$1
( trap 'echo "engine got SIGTERM" >> "$log"; exit 0' TERM; echo "engine ready" >> "$log"
  while :; do sleep 0.05; done ) &
trap 'echo "worker got SIGTERM" >> "$log"; sleep 0.3; echo "worker exits" >> "$log"; exit 0' TERM
echo "worker ready" >> "$log"
while :; do sleep 0.05; done
"""


def test_the_launcher_signals_the_worker_before_its_engine_processes(tmp_path):
    """vLLM's engine processes abort their requests on a SIGTERM of their own, so they
    may get one only once the worker has drained and exited."""
    log = tmp_path / "signals.log"
    process = subprocess.Popen(["bash", "-c", WORKER_AND_ENGINE, "worker", str(log)], start_new_session=True)
    wait_until(lambda: log.exists() and len(log.read_text().splitlines()) == 2, 10)
    LaunchedWorker("decode", process, tmp_path / "ready.json", tmp_path / "worker.log").stop(grace=10)
    assert log.read_text().splitlines()[2:] == ["worker got SIGTERM", "worker exits", "engine got SIGTERM"]


def test_a_spawned_worker_leads_its_own_process_group_in_the_launchers_session(tmp_path):
    """Its own group, so a stop reaches vLLM's children; the launcher's session, so the
    scheduler shares a core fairly between the engines bound to it (launcher.spawn)."""
    process = spawn(["sleep", "30"], tmp_path / "sleep.log", dict(os.environ))
    try:
        assert os.getpgid(process.pid) == process.pid != os.getpgid(0)
        assert os.getsid(process.pid) == os.getsid(0)
    finally:
        LaunchedWorker("decode", process, tmp_path / "ready.json", tmp_path / "sleep.log").stop(grace=5)
    assert process.poll() is not None


# ---------------------------------------------------------------- real processes, through the OpenAI API

MODEL = "SmolLM2-135M-Instruct"
ROLES = ("prefill", "decode", "decode", "decode")
MAX_TOKENS = 80  # 4 s at 0.05 s a token: long enough to drain while other requests run


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_synthetic_stack(resolve_model(None), tmp_path_factory.mktemp("logs") / "stack.log",
                                 ["--policy", "round_robin", "--heartbeat-timeout-seconds", "30"],
                                 token_seconds=0.05, roles=ROLES) as stack:
        yield stack


def stream(stack, prompt: str):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     stream=True, stream_options={"include_usage": True},
                                     extra_body={"ignore_eos": True})


def complete(stack, prompt: str) -> None:
    reply = httpx.post(stack.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text


def metric(stack, line_start: str) -> float:
    return metric_at(stack.url, line_start)


def placed_on(stack, worker_id: str) -> float:
    return metric(stack, f'kvroute_worker_selected_total{{role="decode",worker="{worker_id}"}}')


def draining_decode_workers(stack) -> float:
    return metric(stack, 'kvroute_workers_draining{role="decode"}')


def workers(stack) -> list[dict]:
    return httpx.get(stack.url + "/admin/workers", timeout=5).json()["workers"]


def decode_worker_of(stack, response_id: str) -> str:
    records = httpx.get(f"{stack.url}/v1/decisions/{response_id}", timeout=5).json()["data"]
    return records[0]["chosen"]["decode_worker"]


def test_sigterm_mid_stream_the_stream_completes_and_new_requests_go_elsewhere(stack):
    prompt = "A worker told to stop finishes what it started."
    expected = "".join(chunk.choices[0].text for chunk in stream(stack, prompt) if chunk.choices)
    migrations = metric(stack, 'kvroute_request_migrations_total{role="decode"}')

    text, usage, draining = [], None, None
    for number, chunk in enumerate(stream(stack, prompt)):
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
        if number == 5:
            draining = decode_worker_of(stack, chunk.id)
            stack.worker_processes[draining].send_signal(signal.SIGTERM)
            wait_until(lambda: draining_decode_workers(stack) == 1, 2)  # its next heartbeat is immediate
            placed_before = placed_on(stack, draining)
            for late in range(4):  # round robin would have sent two of them to it
                complete(stack, f"Arrived after the drain started, number {late}.")
            assert placed_on(stack, draining) == placed_before
            assert stack.worker_processes[draining].poll() is None  # still finishing the stream
            # Out of rotation: /admin/workers lists it as draining, or not at all.
            assert not [w for w in workers(stack) if w["worker_id"] == draining and not w.get("draining")]
    finished_at = time.monotonic()

    assert "".join(text) == expected  # unchanged: no token lost, none repeated, nothing moved
    assert usage.completion_tokens == MAX_TOKENS
    assert metric(stack, 'kvroute_request_migrations_total{role="decode"}') == migrations
    # Its last request done, the worker exits by itself, and leaves the fleet at once.
    assert stack.worker_processes[draining].wait(5) == 0
    assert time.monotonic() - finished_at < 3
    wait_until(lambda: draining_decode_workers(stack) == 0, 2)
    assert draining not in {w["worker_id"] for w in workers(stack)}


def test_an_idle_worker_told_to_stop_exits_at_once(stack):
    idle = next(w["worker_id"] for w in workers(stack) if w["role"] == "decode" and w["in_flight"] == 0)
    process = stack.worker_processes[idle]
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(5) == 0
    assert time.monotonic() - started < 2
    assert httpx.get(stack.url + "/health", timeout=5).status_code == 200  # one decode worker is left
    complete(stack, "Served by the one decode worker left.")
