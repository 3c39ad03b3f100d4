"""Cache-aware placement on real engines: two prefill workers, one decode worker.

A request whose long prefix is already resident goes where it is resident, reports
``cached_tokens > 0``, and its decision record says why; the same prompt from another
tenant matches nothing, and is as slow as a cold prompt (no timing side channel), while
the tenant's own repeat is fast. Neither API keys nor prompt text reach the logs of the
orchestrator or the workers at the default log level. The stack exports its traces to a local
OTLP receiver: one disaggregated request leaves one trace across the orchestrator and both
real engines, their KV pull included.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import time
from dataclasses import dataclass

import httpx
import pytest

from foundation.model_prep import default_cache_dir, resolve_model
from orchestrator.tokenization import TextCodec
from testing.stack import Stack
from tests.otlp_receiver import running_otlp_receiver, trace_of

MODEL = "SmolLM2-135M-Instruct"
AUDIT_KEY = "sk-audit-Qx7Lm2Vz9Rt"  # distinctive, so that finding it in a log means it leaked
ADMIN_KEY = "sk-ops-admin"  # /admin routes need an admin key; tenants' keys get 403 there
KEYS = {"sk-tenant-a": {"tenant": "team-a"}, "sk-tenant-b": {"tenant": "team-b"},
        AUDIT_KEY: {"tenant": "team-audit"}, ADMIN_KEY: {"tenant": "ops", "admin": True}}
SHARED = "You are the assistant of the kvroute repository. Repository map follows. " + " ".join(
    f"src/module_{i}.py defines class Component{i} and function handle_{i}." for i in range(60))


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """The stack, and the receiver of its traces (spans batched for 0.1 s rather than 5)."""
    folder = tmp_path_factory.mktemp("placement")
    keys = folder / "keys.json"
    keys.write_text(json.dumps({"keys": KEYS}))
    with pytest.MonkeyPatch.context() as env, running_otlp_receiver() as receiver:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the SDK's own setting, read by every process started
        stack = Stack(default_cache_dir(), folder / "serve.log",
                      ["--dtype", "float32", "--kv-cache-gib", "0.5", "--max-model-len", "4096",
                       "--topology", "2p1d", "--api-keys", str(keys), "--otlp-endpoint", receiver.url,
                       "--allow-policy-override", "--log-dir", str(folder / "workers")])
        try:
            stack.wait_healthy(900)
            yield stack, receiver
        finally:
            stack.stop()


@pytest.fixture(scope="module")
def stack(traced):
    return traced[0]


def ask(stack: Stack, key: str, question: str, policy: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} | ({"X-KVRoute-Policy": policy} if policy else {})
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SHARED}, {"role": "user", "content": question}]}
    response = httpx.post(stack.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def decision(stack: Stack, key: str, response_id: str) -> dict:
    reply = httpx.get(f"{stack.url}/v1/decisions/{response_id}", headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 200, reply.text
    return reply.json()["data"][0]


def wait_indexed(stack: Stack, minimum_blocks: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    while sum(w["index_blocks"] for w in stack.workers(headers)) < minimum_blocks:
        assert time.monotonic() < deadline, "KV events never reached the index"
        time.sleep(0.2)


def test_api_keys_are_required(stack):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(stack.url + "/v1/chat/completions", json=body).status_code == 401
    wrong = httpx.post(stack.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(stack.url + "/health").status_code == 200


def test_warm_prefix_is_reused_and_explained(stack):
    reset = httpx.post(stack.url + "/admin/reset-cache", json={}, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert reset.status_code == 200, reset.text
    first = ask(stack, "sk-tenant-a", "Which module defines Component7?")
    assert first["usage"]["prompt_tokens"] > 3 * 128
    wait_indexed(stack, minimum_blocks=3)

    second = ask(stack, "sk-tenant-a", "Which function does module 12 define?")
    record = decision(stack, "sk-tenant-a", second["id"])
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert record["predicted_reused_tokens"] > 0
    assert record["actual"]["reused_tokens"] == second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert "holds" in record["reason"] and record["chosen"]["estimate"]["reused_tokens"] > 0


def test_other_tenant_matches_nothing(stack):
    ask(stack, "sk-tenant-a", "Which module defines Component3?")
    wait_indexed(stack, minimum_blocks=3)
    other = ask(stack, "sk-tenant-b", "Which module defines Component3?")
    record = decision(stack, "sk-tenant-b", other["id"])
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert record["predicted_reused_tokens"] == 0
    assert all(plan["estimate"]["reused_tokens"] == 0 for plan in record["alternatives"])


def test_policy_override_header(stack):
    response = ask(stack, "sk-tenant-a", "How many modules are listed?", policy="round_robin")
    assert decision(stack, "sk-tenant-a", response["id"])["policy"] == "round_robin"
    bad = httpx.post(stack.url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-tenant-a",
                                                                  "X-KVRoute-Policy": "fastest"},
                     json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-KVRoute-Policy"


def test_one_trace_follows_a_disaggregated_request_through_both_engines(traced):
    stack, receiver = traced
    reply = ask(stack, "sk-tenant-a", "Which module defines Component41?", policy="least_loaded")
    chosen = decision(stack, "sk-tenant-a", reply["id"])["chosen"]
    assert chosen["kind"] == "disagg"
    wanted = {("kvroute-orchestrator", f"chat {MODEL}"), ("kvroute-orchestrator", "kvroute.placement"),
              ("kvroute-prefill-worker", "kvroute.prefill"), ("kvroute-decode-worker", "kvroute.decode"),
              ("kvroute-decode-worker", "kvroute.kv_pull")}
    trace = trace_of(receiver.wait_for(lambda spans: wanted <= set(trace_of(spans, reply["id"])), 30), reply["id"])
    api = trace["kvroute-orchestrator", f"chat {MODEL}"]
    prefill = trace["kvroute-prefill-worker", "kvroute.prefill"]
    decode = trace["kvroute-decode-worker", "kvroute.decode"]
    pull = trace["kvroute-decode-worker", "kvroute.kv_pull"]
    placement = trace["kvroute-orchestrator", "kvroute.placement"]
    assert prefill.parent_span_id == decode.parent_span_id == placement.parent_span_id == api.span_id
    assert (prefill.resource["service.instance.id"], decode.resource["service.instance.id"]) == (
        chosen["prefill_worker"], chosen["decode_worker"])
    assert api.attributes["gen_ai.usage.input_tokens"] == reply["usage"]["prompt_tokens"]
    # The real connector's pull: what it moved and how long it took, inside the decode that made it.
    assert pull.parent_span_id == decode.span_id and pull.attributes["kvroute.transfer.ok"] is True
    assert pull.attributes["kvroute.transfer.bytes"] > 0 and pull.attributes["kvroute.transfer.seconds"] > 0
    assert decode.start_ns <= pull.start_ns < pull.end_ns <= decode.end_ns


# ---------------------------------------------------------------- tenant timing

# Each word is one token with its leading space, so every notebook is the same length.
WORDS = ("apple river stone cloud garden window silver forest candle bridge market winter summer ocean "
         "mountain paper engine rabbit pencil mirror castle harbor lantern meadow valley thunder orange "
         "violet copper marble basket blanket button cotton dragon feather island jungle kettle ladder "
         "magnet needle orchard parrot puzzle rocket saddle tiger tunnel wagon walnut yellow zebra anchor "
         "barrel cabin desert falcon glacier hammer jacket lemon monkey planet").split()
NOTEBOOK_WORDS = 450  # ~450 prompt tokens: prefill (seconds on CPU) dominates the TTFT of a cold prompt
TIMING_ROUNDS = 6  # one round per order of the three measurements
KINDS = ("b_on_a_prefix", "a_warm", "cold")


def notebook(tag: str, seed: int) -> str:
    rng = random.Random(seed)
    return f"Notebook {tag}. " + " ".join(rng.choice(WORDS) for _ in range(NOTEBOOK_WORDS))


@dataclass
class Sample:
    kind: str
    round: int
    ttft: float  # client side: request sent to the first chunk with content
    prompt_tokens: int
    cached_tokens: int

    def __str__(self) -> str:
        return (f"round {self.round} {self.kind:>13}: ttft {self.ttft * 1000:7.1f} ms, prompt "
                f"{self.prompt_tokens}, cached {self.cached_tokens}")


def streamed(stack: Stack, key: str, system: str, question: str, kind: str = "", round: int = -1) -> Sample:
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    ttft, usage = None, None
    start = time.perf_counter()
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if ttft is None and any(choice["delta"].get("content") for choice in chunk["choices"]):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    assert ttft is not None and usage is not None, "no content or no usage in the stream"
    return Sample(kind, round, ttft, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])


def test_another_tenants_cached_prefix_is_as_slow_as_a_cold_prompt(stack):
    """Tenant B on a prefix tenant A has cached takes as long as a cold prompt of the same
    length (B learns nothing from timing), while A's own repeat is at least 2x faster.
    The three measurements are interleaved, each round in another order, so drifting
    machine load falls on all of them alike."""
    a, b = "sk-tenant-a", "sk-tenant-b"
    question, other_question = "Which word comes first?", "Which word comes last?"
    samples: dict[str, list[Sample]] = {kind: [] for kind in KINDS}
    orders = list(itertools.permutations(KINDS))
    # Round -1 is not counted: it lets the planner learn this machine's prefill speed, as
    # any served traffic would, so that A's repeat is placed by measured costs.
    for round in range(-1, TIMING_ROUNDS):
        prefix, cold_prefix = notebook(f"A{round:02d}", 2 * round), notebook(f"C{round:02d}", 2 * round + 1)
        streamed(stack, a, prefix, question)  # tenant A caches the prefix
        time.sleep(0.5)  # its KV events reach the index, so A's repeat is placed where it is resident
        requests = {"b_on_a_prefix": (b, prefix, question), "a_warm": (a, prefix, other_question),
                    "cold": (b, cold_prefix, question)}
        for kind in orders[round % len(orders)]:
            sample = streamed(stack, *requests[kind], kind=kind, round=round)
            if round >= 0:
                samples[kind].append(sample)

    median = {kind: statistics.median(s.ttft for s in samples[kind]) for kind in KINDS}
    report = "\n".join(str(s) for kind in KINDS for s in samples[kind]) + "\nmedians: " + ", ".join(
        f"{kind} {seconds * 1000:.1f} ms" for kind, seconds in median.items())
    print(report)
    assert all(s.cached_tokens == 0 for s in samples["b_on_a_prefix"] + samples["cold"]), report
    assert all(s.cached_tokens > 0 for s in samples["a_warm"]), report
    assert len({s.prompt_tokens for s in samples["b_on_a_prefix"] + samples["cold"]}) == 1, report
    assert abs(median["b_on_a_prefix"] / median["cold"] - 1) <= 0.15, report
    assert median["a_warm"] <= 0.5 * median["cold"], report


# ---------------------------------------------------------------- nothing secret in the logs

SECRET_PROMPT = "Quillfeather the aardvark recites zygomorphic limericks to Brontide Vasquillo"
SECRET_USER = "user-Hollowmere-5521"
WRONG_KEY = "sk-wrong-Jt4Pw8Rk3Ln"


def test_logs_hold_no_api_key_and_no_prompt(stack):
    """Requests with a distinctive key and prompt (good, bad key, malformed, too long),
    then the orchestrator's and every worker's log (engines included) are searched for
    the key, the prompt text, the user field and the prompt's token ids."""
    chat = {"model": MODEL, "max_tokens": 4, "temperature": 0, "user": SECRET_USER,
            "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    url, good = stack.url + "/v1/chat/completions", {"Authorization": f"Bearer {AUDIT_KEY}"}
    served = httpx.post(url, json=chat, headers=good, timeout=120)
    assert served.status_code == 200, served.text
    with httpx.stream("POST", url, json={**chat, "stream": True}, headers=good, timeout=120) as response:
        assert response.status_code == 200 and "[DONE]" in response.read().decode()
    text = httpx.post(stack.url + "/v1/completions", headers=good, timeout=120,
                      json={"model": MODEL, "prompt": SECRET_PROMPT, "max_tokens": 4, "stop": ["zygomorphic"]})
    assert text.status_code == 200, text.text
    refused = [
        (401, {"Authorization": f"Bearer {WRONG_KEY}"}, json.dumps(chat)),
        (401, {"Authorization": AUDIT_KEY}, json.dumps(chat)),  # the key without "Bearer"
        (400, good, json.dumps(chat)[:-5]),  # not valid JSON
        (400, good, json.dumps({**chat, "logprobs": True})),  # unsupported parameter
        (400, good, json.dumps({**chat, "messages": [{"role": "user", "content": SECRET_PROMPT * 400}]})),
        (400, good, json.dumps({**chat, "messages": SECRET_PROMPT})),  # wrong type
        (404, good, json.dumps({**chat, "model": SECRET_PROMPT})),
    ]
    for status, headers, content in refused:
        reply = httpx.post(url, content=content, timeout=60, headers={**headers, "content-type": "application/json"})
        assert reply.status_code == status, (status, reply.text)
        assert AUDIT_KEY not in reply.text and WRONG_KEY not in reply.text

    time.sleep(1)  # the workers' engines log on their own schedule
    worker_logs = sorted((stack.log_path.parent / "workers").glob("*.log"))
    assert len(worker_logs) == 3  # two prefill workers, one decode worker
    logs = {path.name: path.read_text(errors="replace") for path in [stack.log_path, *worker_logs]}
    assert served.json()["id"] in logs["serve.log"]  # the request was logged, by its id
    token_run = TextCodec(resolve_model(None)).encode_text(" " + SECRET_PROMPT)[2:-2]
    assert len(token_run) >= 5
    secrets = [AUDIT_KEY, WRONG_KEY, SECRET_PROMPT, SECRET_USER, "Quillfeather", "zygomorphic",
               ", ".join(map(str, token_run)), " ".join(map(str, token_run))]
    leaks = [(name, secret) for name, log in logs.items() for secret in secrets if secret in log]
    assert not leaks, f"secrets found in the logs: {leaks}"
