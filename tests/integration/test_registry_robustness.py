"""Forged and malformed heartbeats against a real orchestrator (``kvroute orchestrator`` with
synthetic-engine workers: real processes and sockets): none of them ends the registry's
receive loop, registers a worker or costs the original workers their place, each peer
gets at most a few log lines, a refusal never tells the model fingerprint it wanted,
and a worker that leaves takes its metric series with it."""

from __future__ import annotations

import secrets
import signal
import time

import httpx
import msgspec
import pytest
import zmq

from foundation import wire
from foundation.model_fingerprint import model_fingerprint
from foundation.model_prep import resolve_model
from foundation.zmq_auth import secure_client
from testing.stack import running_synthetic_stack

pytestmark = pytest.mark.timeout(300)

MODEL = "SmolLM2-135M-Instruct"
HEARTBEAT_TIMEOUT = 4.0
MAX_FRAME_BYTES = 65536
FLOOD = 3000  # distinct worker ids, refused ones and malformed ones each


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "stack.log"
    with running_synthetic_stack(resolve_model(None), log,
                                 ["--heartbeat-timeout-seconds", str(HEARTBEAT_TIMEOUT),
                                  "--registry-max-frame-bytes", str(MAX_FRAME_BYTES)],
                                 token_seconds=0.0005, roles=("prefill", "decode", "decode")) as stack:
        yield stack


@pytest.fixture
def registry(stack):
    context = zmq.Context()
    socket = secure_client(context.socket(zmq.DEALER), "orchestrator")
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(stack.registry)
    yield socket
    context.destroy(linger=0)


def heartbeat(fingerprint: str, worker_id: str | None = None, **fields) -> wire.Heartbeat:
    beat = wire.Heartbeat(worker_id=worker_id or f"forged-{secrets.token_hex(6)}", role="prefill",
                          incarnation=secrets.token_hex(8), rpc_address="tcp://127.0.0.1:1", load=wire.WorkerLoad(),
                          sent_at=time.time(), model_fingerprint=fingerprint)
    return msgspec.structs.replace(beat, **fields)


def reply_to(socket, beat: wire.Heartbeat, timeout: float = 10.0) -> wire.RegisterReply:
    """Send ``beat`` on a socket of its own, so no earlier reply is mistaken for its answer."""
    probe = secure_client(socket.context.socket(zmq.DEALER), "orchestrator")
    probe.setsockopt(zmq.LINGER, 0)
    probe.connect(socket.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        probe.send(wire.encode(beat))
        assert probe.poll(timeout * 1000), "the registry no longer answers heartbeats"
        return wire.decode(probe.recv())
    finally:
        probe.close(linger=0)


def complete(stack) -> httpx.Response:
    return httpx.post(stack.url + "/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 4},
                      timeout=30)


def worker_ids(stack) -> set[str]:
    return {worker["worker_id"] for worker in httpx.get(stack.url + "/admin/workers", timeout=5).json()["workers"]}


def test_forged_and_malformed_heartbeats_leave_the_orchestrator_serving(stack, registry):
    original = worker_ids(stack)
    assert original == {"prefill-0", "decode-0", "decode-1"}
    fingerprint = model_fingerprint(resolve_model(None))
    log_lines_before = fleet_warnings(stack)

    garbage = reply_to(registry, heartbeat(fingerprint, rpc_address="garbage"))
    assert not garbage.accepted and "rpc_address" in garbage.reason
    for frames in ([b"\x00 not msgpack"], [wire.encode(wire.StatsRequest())], [b"one", b"two"],
                   [wire.encode(heartbeat(fingerprint))[:-3]]):
        registry.send_multipart(frames)
    oversized = secure_client(registry.context.socket(zmq.DEALER), "orchestrator")
    oversized.connect(stack.registry)
    oversized.send(b"\x81" + b"x" * MAX_FRAME_BYTES)  # libzmq drops this connection before anyone reads it
    for _ in range(FLOOD):
        registry.send(wire.encode(heartbeat("f" * 16)))  # wrong model, each under a new id
        registry.send(wire.encode(heartbeat(fingerprint, kv_events_address="tcp://*:1")))  # malformed

    refused = reply_to(registry, heartbeat("0" * 16))  # answered after the flood: the loop still runs
    assert not refused.accepted and "does not match" in refused.reason
    assert fingerprint not in refused.reason and "0" * 16 not in refused.reason
    time.sleep(HEARTBEAT_TIMEOUT + 1)  # had the loop died, every worker would have expired by now
    assert worker_ids(stack) == original
    assert complete(stack).status_code == 200
    # Thousands of bad messages from one peer: a few warnings, not one each.
    assert fleet_warnings(stack) - log_lines_before <= 5
    oversized.close(linger=0)


def test_a_departed_workers_metric_series_leave_metrics(stack):
    for _ in range(6):  # requests, so per-worker counters exist beside the per-worker gauges
        assert complete(stack).status_code == 200
    assert 'worker="decode-1"' in httpx.get(stack.url + "/metrics", timeout=5).text
    stack.worker_processes["decode-1"].send_signal(signal.SIGKILL)
    deadline = time.monotonic() + HEARTBEAT_TIMEOUT + 10  # marked down once its heartbeats stop
    while left := [line for line in httpx.get(stack.url + "/metrics", timeout=5).text.splitlines()
                   if "decode-1" in line]:
        assert time.monotonic() < deadline, f"series of a departed worker left behind: {left}"
        time.sleep(0.5)
    assert "decode-1" not in worker_ids(stack)
    assert complete(stack).status_code == 200


def fleet_warnings(stack) -> int:
    return sum("kvroute.orchestrator.fleet: from 127.0.0.1" in line
               for line in stack.log_path.read_text(errors="replace").splitlines())
