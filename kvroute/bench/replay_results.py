"""Per-policy summaries of replayed requests: percentiles, hit rate, where the load went.

Pure functions over ``replay.Row``s. A request counts as succeeded when it got a first
token and no error; latency percentiles and the hit rate are over succeeded requests only,
the placement counts marked "placed" over every request that got a plan.

* percentiles: numpy's default (linear interpolation between the closest ranks), so P99
  over ~100 requests lies between the two largest samples;
* hit rate: cached / prompt tokens summed over requests (``usage.prompt_tokens_details``),
  so long prompts weigh more than short ones, as they do in prefill time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict

import numpy as np

from kvroute.bench.replay import Row
from simulator.records import percentile

# An estimate off by less than one block is rounding, not a stale index.
MISPREDICTION_TOKENS = 128
# A hand-off this slow is a failed pull (recomputed on the decode worker) or a starved process.
SLOW_HANDOFF_S = 5.0
LATENCIES = (("ttft", "ttft_s"), ("second_token", "second_token_s"), ("itl", "itl_s"), ("e2e", "e2e_s"),
             ("queue_wait", "queue_wait_s"), ("server_ttft", "server_ttft_s"),
             ("server_second_token", "server_second_token_s"))


def hit_rate(rows: list[Row]) -> float | None:
    prompt = sum(r.prompt_tokens or 0 for r in rows)
    return sum(r.cached_tokens or 0 for r in rows) / prompt if prompt else None


def latency_summary(rows: list[Row]) -> dict:
    """``<name>_p50_s``, ``_p99_s`` and ``_mean_s`` of every latency in ``LATENCIES``."""
    summary = {}
    for name, key in LATENCIES:
        values = [getattr(r, key) for r in rows if getattr(r, key) is not None]
        summary[f"{name}_p50_s"] = percentile(values, 50)
        summary[f"{name}_p99_s"] = percentile(values, 99)
        summary[f"{name}_mean_s"] = float(np.mean(values)) if values else None
    return summary


def _counts(values) -> dict:
    return dict(Counter(v for v in values if v))


def placement_summary(ok: list[Row], rows: list[Row], labels: dict[str, str]) -> dict:
    label = lambda worker: labels.get(worker, worker)  # noqa: E731
    return {
        "plan_kinds": _counts(r.plan_kind for r in ok),
        "prefilling_worker_counts": _counts(label(r.prefilling_worker) for r in ok if r.prefilling_worker),
        "decode_worker_counts": _counts(label(r.decode_worker) for r in ok if r.decode_worker),
        # failed requests too: where the policy put the load
        "placed_prefilling_worker_counts": _counts(label(r.prefilling_worker) for r in rows if r.prefilling_worker),
    }


def prediction_summary(ok: list[Row]) -> dict:
    """Predicted vs actual reused tokens, over requests whose record has both."""
    judged = [r for r in ok if r.predicted_reused_tokens is not None and r.actual_reused_tokens is not None]
    return {
        "predicted_reused_tokens": sum(r.predicted_reused_tokens for r in judged),
        "actual_reused_tokens": sum(r.actual_reused_tokens for r in judged),
        "overpredicted_requests": sum(r.actual_reused_tokens + MISPREDICTION_TOKENS <= r.predicted_reused_tokens
                                      for r in judged),
        "underpredicted_requests": sum(r.actual_reused_tokens >= r.predicted_reused_tokens + MISPREDICTION_TOKENS
                                       for r in judged),
    }


def summarize(policy: str, rows: list[Row], duration: float, labels: dict[str, str] | None = None) -> dict:
    """One policy's run; ``labels`` renames worker ids (e.g. "prefill-0") in the counts."""
    ok = [r for r in rows if r.succeeded]
    return {
        "policy": policy, "requests": len(rows), "succeeded": len(ok), "errors": len(rows) - len(ok),
        "duration_s": duration, "throughput_rps": len(ok) / duration if duration > 0 else None,
        "hit_rate": hit_rate(ok), "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "max_send_lateness_s": max((r.sent_s - r.scheduled_s for r in rows), default=None),
        "wrong_policy_records": sum(r.decision_policy not in (None, policy) for r in rows),
        "missing_decision_records": sum(r.plan_kind is None for r in ok),
        **placement_summary(ok, rows, labels or {}),
        **prediction_summary(ok),
        "slow_handoffs_over_5s": sum((r.second_token_s or 0) > SLOW_HANDOFF_S for r in ok),
        **latency_summary(ok),
    }


def ratios(summaries: dict[str, dict]) -> dict:
    """cache_aware against round_robin at P50 TTFT and against the best baseline at P99 TTFT."""
    out: dict = {}
    ca, rr = summaries.get("cache_aware"), summaries.get("round_robin")
    if ca and rr and ca["ttft_p50_s"] and rr["ttft_p50_s"]:
        out["cache_aware_over_round_robin_p50_ttft"] = ca["ttft_p50_s"] / rr["ttft_p50_s"]
    baselines = {name: s for name, s in summaries.items() if name != "cache_aware" and s["ttft_p99_s"]}
    if ca and ca["ttft_p99_s"] and baselines:
        best = min(baselines, key=lambda name: baselines[name]["ttft_p99_s"])
        out["best_baseline_p99_ttft"] = best
        out["cache_aware_over_best_baseline_p99_ttft"] = ca["ttft_p99_s"] / baselines[best]["ttft_p99_s"]
    return out


def row_dict(row: Row) -> dict:
    """A request row for results.json; chunk times keep their unit in the name."""
    return {k: v for k, v in asdict(row).items() if k != "chunk_times"} | {"chunk_times_s": row.chunk_times}
