"""The replay's view of a running cluster: who it serves, which policies it lets a request pick,
and how to start every policy cold.

Failures a user can fix (wrong URL, missing API key, a server without
``--allow-policy-override``, an unknown policy) raise ``ReplayError`` with a message that
says what to do, not a stack trace.

Cache reset, per policy::

    wait until no worker runs or queues a request (stragglers of the previous policy)
    POST /admin/reset-cache            retried while a worker answers 503
    one tiny request per prefill worker: an idle vLLM engine publishes the reset
        (AllBlocksCleared) only at its next step, and until then the index, reloaded
        from the worker's snapshot, still lists the old blocks; a prompt shorter than
        one block stores nothing (a raw completion: a chat template alone fills a
        32-token block)
    wait until the index lists no block
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from kvroute.bench.replay import POLICY_HEADER, ReplayTarget

RESET_ATTEMPTS = 5
RESET_RETRY_S = 5
IDLE_TIMEOUT_S = 120
INDEX_EMPTY_TIMEOUT_S = 30
TINY_PROMPT = "Hi"

Warn = Callable[[str], None]


class ReplayError(Exception):
    """Something about the server or the arguments that the user must fix."""


class ReplayServer:
    def __init__(self, url: str, api_key: str = "", timeout_s: float = 60,
                 transport: httpx.BaseTransport | None = None):
        """``transport``: for tests that answer without a server."""
        self.url = url.rstrip("/")
        self.api_key = api_key
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=auth, timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self.client.close()

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            reply = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise ReplayError(f"cannot reach {self.url}: {type(error).__name__}: {error}") from None
        if reply.status_code == 401:
            raise ReplayError(f"{self.url} wants an API key: pass --api-key")
        return reply

    def model_name(self) -> str:
        """The served model's name, from ``/v1/models``."""
        reply = self._request("GET", "/v1/models")
        try:
            return reply.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ReplayError(f"{self.url}/v1/models answered {reply.status_code} without a model: "
                              "is this an OpenAI-compatible server?") from None

    def target(self, model: str, request_timeout_s: float) -> ReplayTarget:
        return ReplayTarget(self.url, model, self.api_key, request_timeout_s)

    def check_policies(self, model: str, policies: list[str]) -> None:
        """One one-token request per policy, so a bad name or a server that ignores the
        header fails before anything is measured."""
        for policy in policies:
            reply = self._request("POST", "/v1/completions", headers={POLICY_HEADER: policy},
                                  json={"model": model, "prompt": "Hello", "max_tokens": 1})
            if reply.status_code != 200:
                raise ReplayError(self._policy_refusal(policy, reply))

    def _policy_refusal(self, policy: str, reply: httpx.Response) -> str:
        try:
            error = reply.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"a test request with policy {policy!r} got {reply.status_code}: {reply.text[:300]}"
        if error.get("code") == "policy_override_disabled":
            return (f"{self.url} does not let requests choose a policy: start the orchestrator with "
                    "--allow-policy-override")
        return f"policy {policy!r}: {error.get('message', error)}"

    def workers(self) -> list[dict]:
        reply = self._request("GET", "/admin/workers")
        reply.raise_for_status()
        return reply.json()["workers"]

    def wait_idle(self, timeout_s: float, warn: Warn) -> bool:
        """Until no worker runs or queues a request."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(_is_idle(w) for w in self.workers()):
                return True
            time.sleep(1)
        busy = [(w["worker_id"], w["in_flight"], w["load"]["num_running"]) for w in self.workers()]
        warn(f"workers still busy {timeout_s:.0f} s after the last request: {busy}")
        return False

    def reset_cache(self, model: str, warn: Warn) -> dict:
        """Start the next policy cold (see the module docstring). Returns what happened:
        ``reset`` (bool), ``supported`` (False: the server refuses resets), ``attempts``,
        and the index blocks per worker right after the reset and when measuring starts."""
        report: dict = {"idle_before_reset": self.wait_idle(IDLE_TIMEOUT_S, warn)}
        report.update(self._post_reset(warn))
        if not report["supported"]:
            return report
        report["index_blocks_after_reset"] = _index_blocks(self.workers())
        self._step_every_engine(model)
        report["index_blocks_at_start"] = self._wait_index_empty(INDEX_EMPTY_TIMEOUT_S, warn)
        return report

    def _post_reset(self, warn: Warn) -> dict:
        for attempt in range(1, RESET_ATTEMPTS + 1):
            # JSON, empty: kvroute refuses a state-changing admin request that a cross-site form could send.
            reply = self._request("POST", "/admin/reset-cache", json={})
            if reply.status_code in (403, 404, 405):
                warn(f"the server does not allow cache resets ({reply.status_code}; kvroute needs an admin key); "
                     "this policy starts with whatever the caches hold")
                return {"reset": False, "supported": False, "attempts": attempt}
            if reply.status_code == 200 and _json(reply).get("reset"):
                return {"reset": True, "supported": True, "attempts": attempt}
            detail = _json(reply).get('workers', reply.text[:300])
            warn(f"reset-cache attempt {attempt} failed: {reply.status_code} {detail}")
            time.sleep(RESET_RETRY_S)
        warn("reset-cache kept failing; this policy starts with whatever the caches hold")
        return {"reset": False, "supported": True, "attempts": RESET_ATTEMPTS}

    def _step_every_engine(self, model: str) -> None:
        prefill_workers = sum(w["role"] == "prefill" for w in self.workers())
        body = {"model": model, "prompt": TINY_PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        for _ in range(prefill_workers):  # round robin: each prefill worker gets one
            self._request("POST", "/v1/completions", json=body,
                          headers={POLICY_HEADER: "round_robin"}).raise_for_status()

    def _wait_index_empty(self, timeout_s: float, warn: Warn) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.workers()
            left = _index_blocks(workers)
            if all(w["index_blocks"] == 0 and w["in_flight"] == 0 for w in workers) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if any(left.values()):
            warn(f"the index still lists blocks {timeout_s:.0f} s after reset-cache: {left}")
        return left


def _is_idle(worker: dict) -> bool:
    load = worker["load"]
    return worker["in_flight"] == 0 and load["num_running"] == 0 and load["num_waiting"] == 0


def _index_blocks(workers: list[dict]) -> dict[str, int]:
    return {w["worker_id"]: w["index_blocks"] for w in workers}


def _json(reply: httpx.Response) -> dict:
    try:
        body = reply.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
