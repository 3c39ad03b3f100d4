"""A decode worker dies mid-stream, with real engines: ``kvroute serve`` with one prefill and
two decode workers, and the decode worker of a streaming greedy completion killed with
SIGKILL (its whole process group, vLLM's engine core included) after a few chunks. The
orchestrator sees the connection drop, moves the request to the other decode worker with
the prompt plus the tokens already sent, and the client's stream goes on: no error, no
token lost or repeated.

Greedy decoding need not come out bit-identical on the second engine: it computes the
tokens already generated in one prefill, where the first engine decoded them one by one,
and float rounding differs. So the text either equals an uninterrupted run, or first
differs at a token where that run's two best candidates were all but tied. The API refuses
``logprobs``; the gap is asked of a surviving worker over its RPC.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from foundation import wire
from foundation.model_prep import default_cache_dir, resolve_model
from orchestrator.tokenization import TextCodec
from orchestrator.worker_client import WorkerClient
from testing.stack import Stack
from tests.cluster import assert_stops_leaving_nothing

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 48
KILL_AFTER_CHUNKS = 4
HEARTBEAT_TIMEOUT = 60.0  # long: a migration that waited for the heartbeats to stop would stand out
TIE_GAP = 0.05  # top-2 log-probability gap below which a greedy choice may flip between engines
PROMPT = ("The kvroute operations handbook. Chapter 3: what happens when a worker fails.\n\n" + "\n".join(
    f"Step {i}: the orchestrator reads the heartbeat of worker {i % 5}, compares its queue of "
    f"{3 * i} requests with the others, and writes down how many free blocks it reports." for i in range(1, 13))
    + "\n\nIn short, when a decode worker stops answering,")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("migration")
    stack = Stack(default_cache_dir(), folder / "serve.log",
                  ["--dtype", "float32", "--kv-cache-gib", "0.5", "--max-model-len", "4096",
                   "--topology", "1p2d", "--policy", "least_loaded",
                   "--heartbeat-timeout-seconds", str(HEARTBEAT_TIMEOUT), "--log-dir", str(folder / "workers")])
    try:
        stack.wait_healthy(900)
        wait_workers(stack, 3, 120)  # /health needs only one worker of each role
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def wait_workers(stack: Stack, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(stack.workers()) < count:
        assert time.monotonic() < deadline, f"fewer than {count} workers registered after {timeout:.0f} s"
        time.sleep(0.5)


def stream(client):
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     stream=True, stream_options={"include_usage": True},
                                     extra_body={"ignore_eos": True})


def decisions_of(stack: Stack, response_id: str) -> list[dict]:
    return httpx.get(f"{stack.url}/v1/decisions/{response_id}", timeout=5).json()["data"]


def decode_migrations(stack: Stack) -> float:
    families = text_string_to_metric_families(httpx.get(stack.url + "/metrics", timeout=5).text)
    return sum(sample.value for family in families for sample in family.samples
               if sample.name == "kvroute_request_migrations_total" and sample.labels.get("role") == "decode")


# ---------------------------------------------------------------- worker processes


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: state, ppid, pgrp, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state, _, pgrp = _stat_fields(int(entry.name))[:3]
            except OSError:
                continue
            if int(pgrp) == pgid and state != "Z":
                members.append(int(entry.name))
    return members


def worker_process(log_dir: Path, worker_id: str) -> int:
    """The pid of the worker's own process. Its ready file names the worker; its command line
    names the ready file; it leads its process group (the launcher starts one per worker)."""
    ready = next(path for path in log_dir.glob("*.ready.json")
                 if json.loads(path.read_text())["worker_id"] == worker_id)
    leaders = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                arguments = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
                if str(ready) in arguments and int(_stat_fields(int(entry.name))[2]) == int(entry.name):
                    leaders.append(int(entry.name))
            except OSError:
                continue
    assert len(leaders) == 1, f"worker {worker_id}: processes {leaders} for {ready}"
    return leaders[0]


def kill_worker(stack: Stack, worker_id: str) -> None:
    """SIGKILL the worker's whole process group, as a crash of its machine would; returns
    once no process of the group is left running."""
    pid = worker_process(stack.log_path.parent / "workers", worker_id)
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while group_members(pid):
        assert time.monotonic() < deadline, f"still running after SIGKILL: {group_members(pid)}"
        time.sleep(0.05)


# ---------------------------------------------------------------- the reference's log-probabilities


async def greedy_with_logprobs(rpc_address: str,
                               prompt_token_ids: list[int]) -> tuple[list[int], list[wire.TokenLogprobs]]:
    client = WorkerClient(rpc_address)
    sampling = wire.SamplingSpec(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    request = wire.GenerateRequest(request_id=f"gap-{uuid.uuid4().hex}", prompt_token_ids=prompt_token_ids,
                                   sampling=sampling)
    token_ids, ranked = [], []
    try:
        async for chunk in client.generate(request, timeout=120):
            token_ids += chunk.token_ids
            ranked += chunk.logprobs or []
    finally:
        await client.close()
    return token_ids, ranked


def detokenize(codec: TextCodec, token_ids: list[int]) -> str:
    """As the API's text stream does: special tokens skipped, spaces left as they are."""
    return codec.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def first_divergence(stack: Stack, reference: str, text: str) -> tuple[int, float]:
    """The token where ``text`` first leaves ``reference``, and the reference's top-2
    log-probability gap there, from the same greedy run on a surviving worker's engine."""
    codec = TextCodec(resolve_model(None))
    address = next(w["rpc_address"] for w in stack.workers() if w["role"] == "prefill")
    token_ids, ranked = asyncio.run(greedy_with_logprobs(address, codec.encode_text(PROMPT)))
    assert detokenize(codec, token_ids) == reference, "the engine does not reproduce the uninterrupted run"
    position = next(k for k in range(len(token_ids)) if not text.startswith(detokenize(codec, token_ids[:k + 1])))
    best, second = ranked[position].logprobs[:2]
    return position, best - second


# ---------------------------------------------------------------- the tests


def test_decode_worker_killed_mid_stream_the_stream_goes_on(stack, client):
    started = time.monotonic()
    chunks = list(stream(client))
    reference, reference_seconds = "".join(c.choices[0].text for c in chunks if c.choices), time.monotonic() - started
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    migrations_before = decode_migrations(stack)

    pieces, arrivals, usage, victim, response_id = [], [], None, None, None
    started = time.monotonic()
    for chunk in stream(client):
        if chunk.choices and chunk.choices[0].text:
            pieces.append(chunk.choices[0].text)
            arrivals.append(time.monotonic())
        usage = chunk.usage or usage
        if len(pieces) == KILL_AFTER_CHUNKS and victim is None:
            response_id, victim = chunk.id, decisions_of(stack, chunk.id)[0]["chosen"]["decode_worker"]
            kill_worker(stack, victim)
    elapsed, text = time.monotonic() - started, "".join(pieces)
    longest_pause = max(later - earlier for earlier, later in zip(arrivals, arrivals[1:]))
    print(f"\nuninterrupted: {reference_seconds:.2f} s; killed {victim} after {KILL_AFTER_CHUNKS} chunks: "
          f"stream done in {elapsed:.2f} s, longest pause between chunks {longest_pause:.2f} s")

    assert usage.completion_tokens == MAX_TOKENS
    assert decode_migrations(stack) == migrations_before + 1  # the kill fell mid-stream
    assert decisions_of(stack, response_id)[-1]["chosen"]["decode_worker"] not in (victim, None)
    # The dropped connection is seen at once, not when the worker's heartbeats stop.
    assert longest_pause < HEARTBEAT_TIMEOUT / 4, longest_pause
    assert elapsed < HEARTBEAT_TIMEOUT / 2, elapsed
    if text == reference:
        print("migrated stream identical to the uninterrupted run")
        return
    position, gap = first_divergence(stack, reference, text)
    print(f"migrated stream diverges at token {position}: reference top-2 log-prob gap {gap:.4f}\n"
          f"reference: {reference!r}\nmigrated:  {text!r}")
    assert gap < TIE_GAP, (position, gap, reference, text)


def test_stopping_serve_leaves_no_processes(stack):
    assert_stops_leaving_nothing(stack)
