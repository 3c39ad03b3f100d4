"""End to end through the OpenAI API: ``kvroute serve`` started as a new user would (on an
empty model cache), exercised with the official ``openai`` client, then stopped."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from orchestrator.worker_client import WorkerClient
from testing.stack import Stack, listening_sockets
from tests.cluster import assert_stops_leaving_nothing

MODEL = "SmolLM2-135M-Instruct"
SERVE_ARGS = ["--dtype", "float32", "--kv-cache-gib", "0.5", "--max-model-len", "4096"]
LONG_CONTEXT = "Kvroute routes requests to workers that already hold their context. " * 30


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("fresh-cache")  # nothing prepared: serve must do it all
    stack = Stack(cache_dir, tmp_path_factory.mktemp("logs") / "serve.log", SERVE_ARGS)
    try:
        stack.wait_healthy(900)
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", _strict_response_validation=True)


@pytest.fixture
def async_client(stack):
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", _strict_response_validation=True)


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_models_and_health(client, stack):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(stack.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(stack.url + "/metrics").text
    assert "kvroute_time_to_first_token_seconds" in metrics
    # The default topology (auto) is unified engines only: one per GPU, or one per 8 cores.
    assert float(re.search(r'kvroute_workers\{role="unified"\} (\S+)', metrics).group(1)) >= 1
    assert 'kvroute_workers{role="decode"} 0.0' in metrics
    assert 'kvroute_index_blocks{worker="unified-' in metrics


def http_get(connection: socket.socket, path: str) -> bytes:
    """One HTTP/1.1 request on an open connection; the whole response (head and body)."""
    connection.sendall(f"GET {path} HTTP/1.1\r\nHost: kvroute\r\nConnection: keep-alive\r\n\r\n".encode())
    response = b""

    def complete() -> bool:
        head, separator, body = response.partition(b"\r\n\r\n")
        lengths = [line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
        return bool(separator) and len(body) >= int(lengths[0] if lengths else 0)

    while not complete():
        chunk = connection.recv(65536)
        if not chunk:
            raise ConnectionError(f"the server closed the connection; got {response!r}")
        response += chunk
    return response


def test_no_socket_of_serve_listens_on_a_wildcard_address(stack):
    listening = listening_sockets(stack.process.pid)
    assert any(port == stack.port for _, port in listening), listening  # the probe sees serve's own sockets
    wildcard = [(address, port) for address, port in listening if address in ("0.0.0.0", "::")]
    assert wildcard == [], f"listening beyond loopback with default flags: {wildcard}"
    assert all(address in ("127.0.0.1", "::1") for address, _ in listening), listening


def test_an_idle_keep_alive_connection_outlives_the_clients_expiry(stack):
    """httpx (so the openai package) reuses a connection idle for up to 5 s; a server that
    closes it at 5 s races the client's next request, which then fails before any response."""
    url = urlsplit(stack.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as connection:
        assert http_get(connection, "/health").startswith(b"HTTP/1.1 200")
        time.sleep(6)
        assert http_get(connection, "/health").startswith(b"HTTP/1.1 200")


def test_chat_completion(client):
    response = client.chat.completions.create(model=MODEL, messages=chat("What is the capital of Germany?"),
                                              max_tokens=20, temperature=0)
    choice = response.choices[0]
    assert "Berlin" in choice.message.content
    assert choice.finish_reason == "stop"
    usage = response.usage
    assert usage.completion_tokens > 1 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL, messages=chat("Name three rivers in Europe."), max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions_text_tokens_and_batch(client):
    single = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                       temperature=0)
    assert single.usage.completion_tokens == 6 and single.choices[0].finish_reason == "length"
    batch = client.completions.create(model=MODEL, prompt=["The capital of France is", "One, two, three,"],
                                      max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == single.choices[0].text
    token_ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=4,
                                          temperature=0)
    assert token_ids.usage.prompt_tokens == 5
    # openai's CompletionChoice types finish_reason as never null, yet legacy streams (OpenAI's
    # own included) send null until the last chunk, so strict validation cannot apply here.
    lenient = openai.OpenAI(base_url=str(client.base_url), api_key="unused")
    streamed = list(lenient.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                               temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == single.choices[0].text


def test_exact_output_length_and_stop_strings(client):
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0,
                                       extra_body={"min_tokens": 12, "ignore_eos": True})
    assert forced.usage.completion_tokens == 12
    reference = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=16, temperature=0)
    text = reference.choices[0].text
    stop = text.strip()[3:6] if len(text.strip()) > 6 else text.strip()[:2]
    stopped = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=16, temperature=0,
                                        stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_repeated_request_reports_cached_tokens(client):
    messages = chat(LONG_CONTEXT + " Summarise this in one sentence.")
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 256
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


BAD_REQUESTS = [
    ("bad json", b"{not json", "chat"),
    ("missing messages", {"model": MODEL}, "chat"),
    ("mistyped messages", {"model": MODEL, "messages": "hello"}, "chat"),
    ("empty messages", {"model": MODEL, "messages": []}, "chat"),
    ("unknown role", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "chat"),
    ("unknown model", {"model": "gpt-99", "messages": chat("hi")}, "chat"),
    ("negative max_tokens", {"model": MODEL, "messages": chat("hi"), "max_tokens": -5}, "chat"),
    ("huge max_tokens", {"model": MODEL, "messages": chat("hi"), "max_tokens": 10**9}, "chat"),
    ("mistyped temperature", {"model": MODEL, "messages": chat("hi"), "temperature": "hot"}, "chat"),
    ("n > 1", {"model": MODEL, "messages": chat("hi"), "n": 3}, "chat"),
    ("logprobs", {"model": MODEL, "messages": chat("hi"), "logprobs": True}, "chat"),
    ("tools", {"model": MODEL, "messages": chat("hi"), "tools": [{"type": "function"}]}, "chat"),
    ("unknown parameter", {"model": MODEL, "messages": chat("hi"), "frobnicate": 1}, "chat"),
    ("prompt over context", {"model": MODEL, "prompt": "word " * 5000}, "completions"),
    ("empty prompt", {"model": MODEL, "prompt": ""}, "completions"),
    ("token id out of vocab", {"model": MODEL, "prompt": [10**7]}, "completions"),
    ("min over max", {"model": MODEL, "prompt": "x", "max_tokens": 2, "min_tokens": 5}, "completions"),
    ("body too large", b'{"model": "x", "prompt": "' + b"a" * (9 * 2**20) + b'"}', "completions"),
]


def test_malformed_requests_get_openai_shaped_4xx(stack, client):
    for name, body, endpoint in BAD_REQUESTS:
        url = f"{stack.url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
        content = body if isinstance(body, bytes) else None
        response = httpx.post(url, content=content, json=None if content else body,
                              headers={"content-type": "application/json"}, timeout=30)
        assert 400 <= response.status_code < 500, f"{name}: {response.status_code} {response.text[:200]}"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], name
    assert httpx.get(stack.url + "/v1/nowhere").status_code == 404
    assert "Berlin" in client.chat.completions.create(
        model=MODEL, messages=chat("What is the capital of Germany?"), max_tokens=12, temperature=0
    ).choices[0].message.content


async def _idle(stack: Stack) -> bool:
    for worker in stack.workers():
        client = WorkerClient(worker["rpc_address"])
        try:
            stats = await client.stats()
        finally:
            await client.close()
        if stats.num_active_requests or stats.transfer.active_leases or stats.transfer.active_pulls:
            return False
    return True


async def test_client_disconnect_aborts_on_workers(stack):
    body = {"model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", stack.url + "/v1/completions", json=body) as response:
            received = 0
            async for line in response.aiter_lines():
                received += line.startswith("data:")
                if received >= 5:
                    break
    deadline = time.monotonic() + 20
    while not await _idle(stack):
        assert time.monotonic() < deadline, "the aborted request is still running or holding blocks"
        await asyncio.sleep(0.2)


async def test_sixteen_concurrent_streams(async_client):
    questions = [f"What is {a} plus {b}? Answer with the number." for a, b in zip(range(1, 17), range(20, 36))]

    async def ask(question: str) -> str:
        stream = await async_client.chat.completions.create(model=MODEL, messages=chat(question), max_tokens=16,
                                                            temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    sequential = [await ask(q) for q in questions[:4]]
    concurrent = await asyncio.gather(*(ask(q) for q in questions))
    assert all(concurrent), "a stream came back empty"
    assert concurrent[:4] == sequential


def test_stopping_serve_leaves_no_processes(stack):
    assert_stops_leaving_nothing(stack)
