"""Least privilege and bounded inputs over HTTP, against a real orchestrator with synthetic-engine
workers (real processes and sockets, no model): admin routes need an admin key, a tenant sees
its own decision records only, state-changing admin routes refuse what a cross-site form could
send, bodies (chunked too), request heads, prompts and stop strings are bounded, and the
orchestrator refuses to start exposed without keys or with a key file it cannot fully read."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from foundation.model_prep import resolve_model
from foundation.netutil import free_port
from orchestrator.admin_routes import admin_routers
from testing.stack import SyntheticStack

MODEL = "SmolLM2-135M-Instruct"
ADMIN, TEAM_A, TEAM_B = "sk-ops-admin", "sk-team-a", "sk-team-b"
KEYS = {ADMIN: {"tenant": "ops", "admin": True}, TEAM_A: {"tenant": "team-a"},
        # team-b's bucket holds exactly one request of the most prompts allowed, refilled slowly.
        TEAM_B: {"tenant": "team-b", "rate_limit": 0.01, "burst": 16}}
MAX_BODY, HEAD_TIMEOUT, MAX_HEAD = 65536, 1.0, 8192


def admin_routes() -> list[tuple[str, str]]:
    """Every (method, path) under /admin, read from the routers themselves, so a new route is covered."""
    routers = admin_routers(SimpleNamespace(service=None))
    return [(method, route.path) for router in routers for route in router.routes
            if route.path.startswith("/admin") for method in route.methods]


def write_keys(folder) -> str:
    path = folder / "keys.json"
    path.write_text(json.dumps({"keys": KEYS}))
    return str(path)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("http_security")
    stack = SyntheticStack(resolve_model(None), folder / "stack.log",
                           ["--api-keys", write_keys(folder), "--max-request-bytes", str(MAX_BODY),
                            "--header-timeout-seconds", str(HEAD_TIMEOUT), "--max-header-bytes", str(MAX_HEAD)],
                           token_seconds=0.001)
    try:
        stack.wait_healthy(300)
        yield stack
    finally:
        stack.stop()


def client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


def admin_request(stack, method: str, path: str, key: str | None, **headers) -> httpx.Response:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, stack.url + path, headers={"content-type": "application/json", **auth, **headers},
                         timeout=30)


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert code is None or error["code"] == code, error
    return error


# ---------------------------------------------------------------- roles


def test_every_admin_route_needs_an_admin_key(stack):
    routes = admin_routes()
    assert {("GET", "/admin/workers"), ("POST", "/admin/reset-cache")} <= set(routes)
    for method, path in routes:
        assert_error(admin_request(stack, method, path, None), 401, "invalid_api_key")
        assert_error(admin_request(stack, method, path, "sk-nobody"), 401, "invalid_api_key")
        for tenant_key in (TEAM_A, TEAM_B):
            error = assert_error(admin_request(stack, method, path, tenant_key), 403, "admin_key_required")
            assert error["type"] == "permission_error"
        assert admin_request(stack, method, path, ADMIN).status_code == 200, (method, path)


def test_the_openai_client_sees_permission_denied_on_admin_routes(stack):
    with pytest.raises(openai.PermissionDeniedError):
        client(stack, TEAM_A).get(stack.url + "/admin/workers", cast_to=object)
    assert client(stack, ADMIN).get(stack.url + "/admin/workers", cast_to=object)["workers"]


def test_a_tenant_reads_and_lists_only_its_own_decisions(stack):
    first = client(stack, TEAM_A).completions.create(model=MODEL, prompt="team a asks", max_tokens=2)
    other = client(stack, ADMIN).completions.create(model=MODEL, prompt="ops asks", max_tokens=2)
    team_a, team_b, admin = (client(stack, key) for key in (TEAM_A, TEAM_B, ADMIN))

    mine = team_a.get(f"/decisions/{first.id}", cast_to=object)["data"]
    assert mine and all(r["tenant"] == "team-a" and r["response_id"] == first.id for r in mine)
    with pytest.raises(openai.NotFoundError):  # as if unknown: not even its existence leaks
        team_b.get(f"/decisions/{first.id}", cast_to=object)
    with pytest.raises(openai.NotFoundError):
        team_a.get(f"/decisions/{other.id}", cast_to=object)

    listed_a = team_a.get("/decisions", cast_to=object, options={"params": {"limit": 100}})["data"]
    assert first.id in {r["response_id"] for r in listed_a} and {r["tenant"] for r in listed_a} == {"team-a"}
    listed_b = team_b.get("/decisions", cast_to=object, options={"params": {"limit": 100}})["data"]
    assert all(r["tenant"] == "team-b" for r in listed_b)
    everyone = admin.get("/decisions", cast_to=object, options={"params": {"limit": 100}})["data"]
    assert {first.id, other.id} <= {r["response_id"] for r in everyone}
    assert admin.get(f"/decisions/{first.id}", cast_to=object)["data"][0]["tenant"] == "team-a"


def test_state_changing_admin_routes_refuse_what_a_cross_site_form_could_send(stack):
    form = {"content-type": "application/x-www-form-urlencoded"}
    assert_error(admin_request(stack, "POST", "/admin/reset-cache", ADMIN, **form), 415,
                 "json_content_type_required")
    assert_error(admin_request(stack, "POST", "/admin/reset-cache", ADMIN, origin="https://evil.example"), 403,
                 "cross_site_request")
    assert_error(admin_request(stack, "POST", "/admin/reset-cache", ADMIN, **{"sec-fetch-site": "cross-site"}),
                 403, "cross_site_request")
    same_origin = stack.url
    assert admin_request(stack, "POST", "/admin/reset-cache", ADMIN, origin=same_origin).status_code == 200
    # Reads stay plain GETs.
    assert admin_request(stack, "GET", "/admin/workers", ADMIN, origin="https://evil.example").status_code == 200


# ---------------------------------------------------------------- bounded inputs


def raw_exchange(stack, payload: bytes, then: bytes = b"", wait: float = 0.0) -> bytes:
    """Send ``payload`` (and ``then`` after ``wait`` seconds), then read until the server closes."""
    with socket.create_connection(("127.0.0.1", stack.port), timeout=15) as connection:
        connection.sendall(payload)
        if wait:
            time.sleep(wait)
        if then:
            try:
                connection.sendall(then)
            except OSError:
                pass  # already closed
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
        return received


def test_a_chunked_body_over_the_limit_gets_413_before_it_ends(stack):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{stack.port}\r\nAuthorization: Bearer {TEAM_A}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"x" * MAX_BODY
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[i:i + 8192]
                                                                      for i in range(0, len(body), 8192)))
    # The body never ends (no last chunk): the answer must come as soon as the limit is passed.
    reply = raw_exchange(stack, head + chunks)
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413"), reply[:300]
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert b"connection: close" in headers.lower()
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_declared_body_over_the_limit_gets_413_unread(stack):
    response = httpx.post(stack.url + "/v1/completions", content=b"{" + b" " * MAX_BODY + b"}",
                          headers={"Authorization": f"Bearer {TEAM_A}", "content-type": "application/json"})
    assert_error(response, 413, "request_too_large")


def test_a_head_over_the_limit_gets_431(stack):
    head = f"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: {'p' * MAX_HEAD}\r\n\r\n".encode()
    assert raw_exchange(stack, head).startswith(b"HTTP/1.1 431")


def test_a_head_that_does_not_arrive_in_time_is_closed(stack):
    started = time.monotonic()
    reply = raw_exchange(stack, b"GET /health HTTP/1.1\r\nHost: x\r\n", then=b"\r\n", wait=HEAD_TIMEOUT + 1.5)
    assert reply == b"" and time.monotonic() - started < HEAD_TIMEOUT + 5
    # A head that arrives in time, slowly, is served.
    assert b"200 OK" in raw_exchange(stack, b"GET /health HTTP/1.1\r\nHost: x\r\n", then=b"Connection: close\r\n\r\n",
                                     wait=HEAD_TIMEOUT / 3)


def test_prompts_per_request_are_bounded_and_each_counted(stack):
    team_a, team_b = client(stack, TEAM_A), client(stack, TEAM_B)
    with pytest.raises(openai.BadRequestError) as refused:
        team_a.completions.create(model=MODEL, prompt=["p"] * 17, max_tokens=1)
    assert refused.value.body["code"] == "too_many_prompts" and refused.value.body["param"] == "prompt"

    sixteen = team_b.completions.create(model=MODEL, prompt=[f"prompt {i}" for i in range(16)], max_tokens=1)
    assert len(sixteen.choices) == 16
    with pytest.raises(openai.RateLimitError):  # the 16 prompts took team-b's whole burst
        team_b.completions.create(model=MODEL, prompt="one more", max_tokens=1)


@pytest.mark.parametrize("stop, code", [(["a", "b", "c", "d", "e"], "too_many_stop_sequences"),
                                        (["x" * 257], "stop_sequence_too_long")])
def test_stop_sequences_are_bounded(stack, stop, code):
    team_a = client(stack, TEAM_A)
    with pytest.raises(openai.BadRequestError) as refused:
        team_a.completions.create(model=MODEL, prompt="hi", max_tokens=2, stop=stop)
    assert refused.value.body["code"] == code and refused.value.body["param"] == "stop"
    with pytest.raises(openai.BadRequestError) as refused:
        team_a.chat.completions.create(model=MODEL, max_tokens=2, stop=stop,
                                       messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["code"] == code


def test_stop_sequences_at_the_limits_are_served(stack):
    served = client(stack, TEAM_A).completions.create(model=MODEL, prompt="hi", max_tokens=2, stop=["x" * 256] * 4)
    assert served.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- a separate admin listener


def test_a_separate_admin_listener_takes_admin_routes_and_metrics_off_the_api_port(tmp_path):
    admin_port = free_port()
    stack = SyntheticStack(resolve_model(None), tmp_path / "stack.log",
                           ["--api-keys", write_keys(tmp_path), "--admin-port", str(admin_port)],
                           token_seconds=0.001, roles=())  # the routes, not the workers, are the point
    admin_url = f"http://127.0.0.1:{admin_port}"
    try:
        wait_listening(admin_url + "/metrics", stack, 120)
        for path in ("/metrics", "/admin/workers"):
            assert_error(httpx.get(stack.url + path, headers={"Authorization": f"Bearer {ADMIN}"}), 404)
        assert httpx.get(admin_url + "/metrics").status_code == 200
        for method, path in admin_routes():
            url = admin_url + path
            headers = {"content-type": "application/json"}
            assert_error(httpx.request(method, url, headers={**headers, "Authorization": f"Bearer {TEAM_A}"}), 403)
            assert httpx.request(method, url, headers={**headers, "Authorization": f"Bearer {ADMIN}"},
                                 timeout=30).status_code == 200
    finally:
        stack.stop()


def wait_listening(url: str, stack: SyntheticStack, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert stack.process.poll() is None, stack.log_path.read_text()[-3000:]
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.TransportError:
            time.sleep(0.3)
    raise AssertionError(f"{url} not listening after {timeout:.0f} s")


# ---------------------------------------------------------------- refusing to start


def kvroute(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvroute", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["orchestrator", "serve"])
def test_an_exposed_host_without_keys_refuses_to_start(command):
    result = kvroute(command, "--host", "0.0.0.0", "--port", str(free_port()))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--api-keys" in lines[0] and "--allow-unauthenticated" in lines[0], result.stderr


@pytest.mark.parametrize("content, says", [
    ({"sk-team-a": {"tenant": "team-a"}}, "expected a top-level 'keys:' mapping"),
    ({"keys": {}}, "expected a top-level 'keys:' mapping"),
    ({"keys": {"sk-team-a": {"tenant": "team-a", "admn": True}}}, "unknown fields 'admn'"),
])
def test_a_key_file_kvroute_cannot_fully_read_refuses_to_start(tmp_path, content, says):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(content))
    result = kvroute("orchestrator", "--api-keys", str(path), "--model", resolve_model(None),
                     "--port", str(free_port()), "--registry-port", str(free_port()))
    assert result.returncode == 2 and says in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
