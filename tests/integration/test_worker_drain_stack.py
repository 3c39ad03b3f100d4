"""Graceful drain with real processes: the launcher signals a worker before its engine
processes, and, through the OpenAI API, an orchestrator and synthetic-engine workers
(``testing.synthetic_worker``, tokens a pure function of the context), one of which is sent
SIGTERM mid-stream: its stream completes and new requests go elsewhere (decode workers and
unified replicas alike)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

from foundation.launcher import LaunchedWorker, spawn
from foundation.model_prep import resolve_model
from testing.stack import running_synthetic_stack
from tests.cluster import metric_at


def wait_until(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


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


def test_a_unified_worker_told_to_stop_mid_stream_finishes_it_and_leaves(tmp_path):
    with running_synthetic_stack(resolve_model(None), tmp_path / "stack.log",
                                 ["--policy", "round_robin", "--heartbeat-timeout-seconds", "30"],
                                 token_seconds=0.05, roles=("unified", "unified", "unified")) as replicas:
        prompt = "A replica told to stop finishes what it started."
        expected = "".join(chunk.choices[0].text for chunk in stream(replicas, prompt) if chunk.choices)
        text, draining = [], None
        for number, chunk in enumerate(stream(replicas, prompt)):
            if chunk.choices:
                text.append(chunk.choices[0].text)
            if number == 5:
                draining = decode_worker_of(replicas, chunk.id)
                replicas.worker_processes[draining].send_signal(signal.SIGTERM)
                wait_until(lambda: metric(replicas, 'kvroute_workers_draining{role="unified"}') == 1, 2)
                placed_before = placed_on(replicas, draining)
                for late in range(3):  # round robin over three replicas would have sent one to it
                    complete(replicas, f"Arrived after the drain started, number {late}.")
                assert placed_on(replicas, draining) == placed_before
        assert "".join(text) == expected
        assert replicas.worker_processes[draining].wait(5) == 0
        wait_until(lambda: draining not in {w["worker_id"] for w in workers(replicas)}, 2)
        assert httpx.get(replicas.url + "/health", timeout=5).json()["unified_workers"] == 2
