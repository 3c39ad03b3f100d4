"""Unified workers through the whole orchestrator (synthetic engines): they register in both
pools, serve requests alone or hand off between replicas, and mixed pools work."""

from __future__ import annotations

import concurrent.futures

import httpx

from foundation.model_prep import resolve_model
from testing.stack import running_synthetic_stack

MODEL = "SmolLM2-135M-Instruct"


def complete(url: str, prompt: str, policy: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, headers={"X-KVRoute-Policy": policy}, timeout=60)
    assert response.status_code == 200, response.text
    decisions = httpx.get(f"{url}/v1/decisions/{response.json()['id']}", timeout=10).json()["data"]
    return {"usage": response.json()["usage"], "plan": decisions[0]["chosen"]}


def test_two_unified_replicas_serve_alone_and_hand_off_between_them(tmp_path):
    with running_synthetic_stack(resolve_model(None), tmp_path / "stack.log", ["--allow-policy-override"],
                                 token_seconds=0.01, roles=("unified", "unified")) as stack:
        health = httpx.get(stack.url + "/health", timeout=5).json()
        assert (health["status"], health["unified_workers"], health["prefill_workers"]) == ("ok", 2, 0)
        workers = httpx.get(stack.url + "/admin/workers", timeout=5).json()["workers"]
        roles = {w["worker_id"]: w["role"] for w in workers}
        assert roles == {"unified-0": "unified", "unified-1": "unified"}
        # round robin picks each replica in turn and serves the request there
        plans = [complete(stack.url, f"question {i}", "round_robin")["plan"] for i in range(4)]
        assert {(p["kind"], p["decode_worker"]) for p in plans} == {("local", "unified-0"), ("local", "unified-1")}
        assert all(p["prefill_worker"] is None for p in plans)
        # many at once under cache_aware: every one answered in full, and none hands off to itself
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: complete(stack.url, f"shared prefix {'x ' * 200} {i}", "cache_aware"),
                                    range(16)))
        assert all(r["usage"]["completion_tokens"] == 6 for r in results)
        assert all(r["plan"]["prefill_worker"] != r["plan"]["decode_worker"] for r in results)
        metrics = httpx.get(stack.url + "/metrics", timeout=5).text
        assert 'kvroute_workers{role="unified"} 2.0' in metrics


def test_a_mixed_pool_hands_off_from_a_prefill_worker_to_a_unified_one(tmp_path):
    with running_synthetic_stack(resolve_model(None), tmp_path / "stack.log", ["--allow-policy-override"],
                                 token_seconds=0.01, roles=("prefill", "unified")) as stack:
        assert httpx.get(stack.url + "/health", timeout=5).json()["status"] == "ok"  # no decode worker needed
        # round robin over the prefill pool (prefill-0, unified-0): a hand-off, then the replica alone
        plans = [complete(stack.url, f"mixed {i}", "round_robin")["plan"] for i in range(2)]
        assert [(p["kind"], p["prefill_worker"], p["decode_worker"]) for p in plans] == [
            ("disagg", "prefill-0", "unified-0"), ("local", None, "unified-0")]
        # A stream's TPOT target: asked for in a header, bounded; the records carry the stall fields.
        body = {"model": MODEL, "prompt": "tpot", "max_tokens": 4, "ignore_eos": True}
        refused = httpx.post(stack.url + "/v1/completions", json=body, headers={"X-KVRoute-TPOT-Target": "fast"},
                             timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_tpot_target"
        answered = httpx.post(stack.url + "/v1/completions", json=body, headers={"X-KVRoute-TPOT-Target": "0.05"},
                              timeout=60)
        assert answered.status_code == 200, answered.text
        (record,) = httpx.get(f"{stack.url}/v1/decisions/{answered.json()['id']}", timeout=10).json()["data"]
        assert record["predicted_stall_seconds"] >= 0 and "stall" in record["chosen"]["estimate"]
        assert {"stall_seconds", "stalled_streams"} <= record["actual"].keys()
