"""The orchestrator restarts under running workers: real processes, real engines.

``kvroute orchestrator`` runs on fixed ports with two prefill workers and one decode
worker reporting to it, as ``deploy/start-pool.sh`` starts them. After a request has
made a long prefix resident, the orchestrator is killed with a second request still
streaming, and a new one starts on the same ports. It knows nothing but what the workers
tell it: their heartbeats re-register them (same incarnations: nobody restarted), their
resident-block snapshots rebuild the index before any new request arrives, and the
next request with that prefix is placed on a worker that holds it and reuses it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from foundation.launcher import LaunchedWorker, tail
from foundation.model_prep import resolve_model
from foundation.netutil import free_port
from tests.cluster import START_TIMEOUT, start_worker

MODEL = "SmolLM2-135M-Instruct"
BLOCK_TOKENS = 128
SHARED = "You are the assistant of the kvroute repository. Repository map follows. " + " ".join(
    f"src/module_{i}.py defines class Component{i} and function handle_{i}." for i in range(60))


class Orchestrator:
    """``kvroute orchestrator`` in its own process group; ``kill`` is a crash, not a stop."""

    def __init__(self, port: int, registry_port: int, log_path: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "kvroute", "orchestrator", "--port", str(port),
                   "--registry-port", str(registry_port), "--model", resolve_model(None), "--max-model-len", "4096"]
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/admin/workers", timeout=5).json()["workers"]

    def wait_workers(self, count: int, timeout: float) -> list[dict]:
        """Until ``count`` workers are live (registered, connected); returns them."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"orchestrator exited:\n{tail(self.log_path)}"
            try:
                workers = self.workers()
                if len(workers) >= count:
                    return workers
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"fewer than {count} workers after {timeout:.0f} s"
            time.sleep(0.25)

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Ports fixed for the module; two prefill workers and one decode worker report there."""
    folder = tmp_path_factory.mktemp("orchestrator-restart")
    ports = {"port": free_port(), "registry_port": free_port()}
    worker_args = ["--orchestrator", f"tcp://127.0.0.1:{ports['registry_port']}", "--block-size", str(BLOCK_TOKENS)]
    orchestrator = Orchestrator(**ports, log_path=folder / "orchestrator.log")
    workers = [start_worker("prefill", folder, "0", worker_args), start_worker("prefill", folder, "1", worker_args),
               start_worker("decode", folder, "1", worker_args)]
    state = {"orchestrator": orchestrator, "workers": workers, "ports": ports, "folder": folder}
    try:
        for worker in workers:
            worker.wait_ready(START_TIMEOUT)
        orchestrator.wait_workers(len(workers), 60)
        yield state
    finally:
        state["orchestrator"].stop()
        with ThreadPoolExecutor(len(workers)) as pool:  # each drains and stops its engine: seconds
            list(pool.map(LaunchedWorker.stop, workers))


def ask(url: str, question: str, max_tokens: int = 4) -> dict:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": SHARED}, {"role": "user", "content": question}]}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def decision(url: str, response_id: str) -> dict:
    reply = httpx.get(f"{url}/v1/decisions/{response_id}", timeout=5)
    assert reply.status_code == 200, reply.text
    return reply.json()["data"][0]


def computing_worker(record: dict) -> str:
    """The worker that computed (or reused) the prompt: the prefill worker unless the plan is LOCAL."""
    chosen = record["chosen"]
    return chosen["prefill_worker"] or chosen["decode_worker"]


def wait_prefix_indexed(orchestrator: Orchestrator, workers: list[str], blocks: int, timeout: float) -> dict[str, int]:
    """Until every one of ``workers`` has ``blocks`` entries in the index; returns every worker's count."""
    deadline = time.monotonic() + timeout
    while True:
        counts = {w["worker_id"]: w["index_blocks"] for w in orchestrator.workers()}
        if all(counts.get(worker, 0) >= blocks for worker in workers):
            return counts
        assert time.monotonic() < deadline, f"index never reached {blocks} blocks on {workers}: {counts}"
        time.sleep(0.2)


def stream_in_background(url: str, question: str) -> tuple[threading.Thread, threading.Event]:
    """A streaming request that runs until its connection breaks; the event is set at its first chunk."""
    started = threading.Event()

    def run():
        body = {"model": MODEL, "max_tokens": 100, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": question}]}
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
                for _ in response.iter_lines():
                    started.set()
        except httpx.HTTPError:
            pass  # the orchestrator died under it, as intended

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, started


def crash_mid_stream(orchestrator: Orchestrator) -> None:
    """SIGKILL with an unrelated request still streaming (its prompt shares no block with SHARED)."""
    stream, streaming = stream_in_background(orchestrator.url, "Write a long story about a lighthouse keeper.")
    assert streaming.wait(60), "the in-flight request never started streaming"
    orchestrator.kill()
    stream.join(10)
    with pytest.raises(httpx.TransportError):
        httpx.get(orchestrator.url + "/health", timeout=2)
    time.sleep(2)  # a few heartbeats go nowhere


def wait_all_idle(orchestrator: Orchestrator, timeout: float) -> None:
    """Until no worker runs or queues anything, as its heartbeats say."""
    deadline = time.monotonic() + timeout
    while True:
        loads = {w["worker_id"]: w["load"] for w in orchestrator.workers()}
        if all(load["num_running"] == 0 and load["num_waiting"] == 0 for load in loads.values()):
            return
        assert time.monotonic() < deadline, f"a request was left running: {loads}"
        time.sleep(0.5)


def test_a_restarted_orchestrator_rebuilds_registry_and_index_from_the_workers(cluster):
    orchestrator = cluster["orchestrator"]
    first = ask(orchestrator.url, "Which module defines Component7?")
    assert first["usage"]["prompt_tokens"] >= 4 * BLOCK_TOKENS
    full_blocks = first["usage"]["prompt_tokens"] // BLOCK_TOKENS
    warm = computing_worker(decision(orchestrator.url, first["id"]))
    wait_prefix_indexed(orchestrator, [warm], full_blocks, timeout=10)
    before = {w["worker_id"]: w for w in orchestrator.workers()}

    crash_mid_stream(orchestrator)
    restarted = cluster["orchestrator"] = Orchestrator(**cluster["ports"], log_path=orchestrator.log_path)
    after = {w["worker_id"]: w for w in restarted.wait_workers(len(before), 60)}
    assert {w: v["incarnation"] for w, v in after.items()} == {w: v["incarnation"] for w, v in before.items()}
    counts = wait_prefix_indexed(restarted, [warm], full_blocks, timeout=30)  # from snapshots alone
    cold = [worker for worker, count in counts.items() if count == 0]
    assert cold, f"every worker holds blocks, so placement could not tell warm from cold: {counts}"
    for worker in cluster["workers"]:
        assert worker.process.poll() is None, f"{worker.role} worker died:\n{tail(worker.log_path)}"

    # A question long enough to fill more blocks: the index learns them from the events after the snapshot.
    question = "Which function does module 12 define? " + "Answer briefly and name the file. " * 40
    second = ask(restarted.url, question)
    record = decision(restarted.url, second["id"])
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and record["actual"]["reused_tokens"] == cached, (second["usage"], record)
    # Only the rebuilt index can have predicted that reuse, and it names a worker that holds the prefix.
    assert record["predicted_reused_tokens"] > 0 and "holds" in record["reason"], record
    chosen = computing_worker(record)
    assert chosen not in cold, (record, counts)
    new_blocks = second["usage"]["prompt_tokens"] // BLOCK_TOKENS - record["predicted_reused_tokens"] // BLOCK_TOKENS
    assert new_blocks >= 2, second["usage"]
    wait_prefix_indexed(restarted, [chosen], counts[chosen] + new_blocks, timeout=10)
    wait_all_idle(restarted, timeout=60)  # the request orphaned by the crash ran to its end
