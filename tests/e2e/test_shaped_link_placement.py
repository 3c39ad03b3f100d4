"""Transfer or recompute, decided by the link, with real engines: ``kvroute serve`` with one
prefill and one decode worker, the prefill worker holding a long prefix, the decode worker
cold. On loopback the planner moves the KV (DISAGG), and reaches the second token no later
than 1.1x aggregated serving (``local_only``) does. With the prefill worker's transfer port
shaped to 50 Mbit/s (``kvroute.bench.shaped_port``) it learns the slow link from the pulls
it sees. Which path is then faster depends on the machine: the prompt's 35 MB of float32
KV take ~5.7 s to pull, and recomputing them took ~4 s on one machine and ~7.7 s on
another. So both paths are measured, recompute (``local_only``) and pull (``round_robin``,
always DISAGG), and the planner must choose the faster one where it is clearly faster (by 25%),
and otherwise reach the second token no later than 1.1 x 1.25 times the faster one. Times are the client's own
(the early first token makes a transfer show in the hand-off, not in TTFT).

Needs root and tc with htb (skipped elsewhere).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from foundation.model_prep import default_cache_dir
from kvroute.bench.shaped_port import ShapedPort
from testing.stack import Stack
from tests.cluster import assert_stops_leaving_nothing
from tests.shaping import UNAVAILABLE

pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no port shaping here: {UNAVAILABLE}")

MODEL = "SmolLM2-135M-Instruct"
SLOW_RATE = "50mbit"  # the prompt's 35 MB of float32 KV take ~5.7 s
CLEAR_MARGIN = 1.25  # one path this much faster than the other must be the one chosen
MAX_RATIO = 1.1
# ~780 tokens: a repository map the prefill worker already holds
PREFIX = "You are the assistant of the kvroute repository. Repository map follows.\n" + "\n".join(
    f"src/pkg_{i}/module_{i}.py: class Handler{i} routes requests of kind {i} to pool {i % 7}."
    for i in range(24))


@dataclass
class Timing:
    response_id: str
    ttft: float
    second_token: float
    text: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shaped")
    stack = Stack(default_cache_dir(), folder / "serve.log",
                  ["--dtype", "float32", "--kv-cache-gib", "0.5", "--max-model-len", "4096",
                   "--topology", "1p1d", "--allow-policy-override",
                   # The shaped port stands for a network between hosts: pulls must cross it.
                   "--no-shared-copies",
                   # A pull over the slow link may take longer than recomputing; it must not time out.
                   "--pull-timeout-seconds", "120",
                   "--log-dir", str(folder / "workers")])
    try:
        stack.wait_healthy(900)
        yield stack
    finally:
        assert_stops_leaving_nothing(stack)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def worker_of(stack: Stack, role: str) -> dict:
    (worker,) = [w for w in stack.workers() if w["role"] == role]
    return worker


def ask(client, question: str, policy: str, prefix: str = PREFIX) -> Timing:
    """Stream a greedy answer; the client's own clock for the first and second token."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, stream=True,
        messages=[{"role": "system", "content": prefix}, {"role": "user", "content": question}],
        extra_headers={"X-KVRoute-Policy": policy}, extra_body={"ignore_eos": True})
    arrivals, text, response_id = [], [], None
    for chunk in stream:
        response_id = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter() - start)
            text.append(chunk.choices[0].delta.content)
    assert len(arrivals) >= 2, f"fewer than two tokens streamed: {text}"
    return Timing(response_id, arrivals[0], arrivals[1], "".join(text))


def decision(stack: Stack, response_id: str) -> dict:
    reply = httpx.get(f"{stack.url}/v1/decisions/{response_id}", timeout=5)
    assert reply.status_code == 200, reply.text
    return reply.json()["data"][-1]


def reset_decode_cache(stack: Stack, timeout: float = 15) -> None:
    """Empty the decode worker's cache only; the prefill worker keeps the prefix."""
    reply = httpx.post(stack.url + "/admin/reset-cache", params={"role": "decode"}, json={}, timeout=30)
    assert reply.status_code == 200 and reply.json()["reset"], reply.text
    assert [w["worker_id"] for w in reply.json()["workers"]] == [worker_of(stack, "decode")["worker_id"]]
    deadline = time.monotonic() + timeout
    while worker_of(stack, "decode")["index_blocks"]:
        assert time.monotonic() < deadline, "the decode worker's index entries outlived its cache reset"
        time.sleep(0.2)


def measure(stack: Stack, client, question: str, policy: str) -> tuple[Timing, dict]:
    """One request from a warm prefill worker to a cold decode worker, and its record."""
    reset_decode_cache(stack)
    timing = ask(client, question, policy)
    return timing, decision(stack, timing.response_id)


def warm_prefill_worker(stack: Stack, client) -> None:
    ask(client, "Which module routes kind 3?", "round_robin")  # DISAGG: computed on the prefill worker
    assert worker_of(stack, "prefill")["index_blocks"] > 0


def teach_link(client, count: int) -> None:
    """Small DISAGG requests (~290 tokens each), whose pulls calibrate the link estimate."""
    for turn in range(count):
        ask(client, "Say hello.", "round_robin",
            prefix=f"Calibration {turn}. " + " ".join(f"word{turn}_{i}" for i in range(50)))


def compare(chosen: Timing, other: Timing) -> str:
    return (f"chosen: TTFT {chosen.ttft:.2f} s, second token {chosen.second_token:.2f} s; "
            f"other: TTFT {other.ttft:.2f} s, second token {other.second_token:.2f} s")


def test_fast_link_moves_the_kv(stack, client):
    teach_link(client, 1)
    warm_prefill_worker(stack, client)
    chosen, record = measure(stack, client, "Which module routes kind 11?", "cache_aware")
    assert record["chosen"]["kind"] == "disagg", record["reason"]
    assert record["actual"]["transfer_bytes"] > 0
    other, other_record = measure(stack, client, "Which module routes kind 12?", "local_only")
    assert other_record["chosen"]["kind"] == "local"
    assert chosen.second_token <= MAX_RATIO * other.second_token, compare(chosen, other)


def test_a_slow_link_is_learned_and_the_faster_path_taken(stack, client):
    prefill = worker_of(stack, "prefill")
    port = int(prefill["transfer_address"].rsplit(":", 1)[1])
    warm_prefill_worker(stack, client)
    recompute, recompute_record = measure(stack, client, "Which module routes kind 20?", "local_only")
    assert recompute_record["chosen"]["kind"] == "local"
    with ShapedPort(port, SLOW_RATE) as shaped:
        teach_link(client, 2)
        assert shaped.shaped_bytes() > 0, "the calibration pulls did not cross the shaped port"
        pull, pull_record = measure(stack, client, "Which module routes kind 22?", "round_robin")
        assert pull_record["chosen"]["kind"] == "disagg" and pull_record["actual"]["transfer_bytes"] > 0
        chosen, record = measure(stack, client, "Which module routes kind 21?", "cache_aware")
    disagg = [plan for plan in [record["chosen"], *record["alternatives"]] if plan["kind"] == "disagg"]
    assert disagg and min(plan["estimate"]["transfer"] for plan in disagg) > 0.25, disagg  # learned
    paths = {"local": recompute.second_token, "disagg": pull.second_token}
    faster, slower = sorted(paths, key=paths.get)
    if paths[slower] > CLEAR_MARGIN * paths[faster]:
        # The chosen request repeats the faster path, so its own time only measures the noise of
        # two runs of one path (13% seen on a busy machine): the choice is what is checked.
        assert record["chosen"]["kind"] == faster, (paths, record["reason"])
    else:
        # Paths this close make either choice right, but never one far slower than the faster.
        bound = CLEAR_MARGIN * MAX_RATIO * paths[faster]
        assert chosen.second_token <= bound, (paths, chosen, record["reason"])


def test_a_reset_of_an_unknown_role_is_refused(stack):
    reply = httpx.post(stack.url + "/admin/reset-cache", params={"role": "gpu"}, json={}, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_role"
