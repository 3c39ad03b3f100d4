"""Runs the simulator made, written as the measurements write real ones
(``kvroute bench trace``, ``kvroute bench placement``): for validating the simulator
against itself, and for the results page built from such runs."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kvroute.bench.placement.cluster import engine_record, kv_cache_tokens
from kvroute.bench.placement.trace import scaled_sample, shares_of_bounds, trace_bounds
from kvroute.bench.replay_results import ratios
from kvroute.bench.simulation.real_run import repository_requests
from simulator import simulate
from simulator.from_replay import cluster_from_replay
from workloads import RepositoryAssistantConfig
from workloads.trace import TraceScaling, read_trace

POLICIES = ("cache_aware", "round_robin")
SCALING = TraceScaling(block_tokens=32, output_scale=1.0, max_context_tokens=4096)
WORKERS = {"prefill-0": "prefill@0", "prefill-1": "prefill@1", "decode-0": "decode@0"}
KV_CACHE_GIB = 0.05
REPOSITORY = RepositoryAssistantConfig(repositories=3, requests=24, rate=0.5, prefix_min_tokens=200,
                                       prefix_max_tokens=400, max_tokens=4)


def write_trace(path: Path) -> Path:
    """Four families of growing prompts (a shared head, then a tail of their own), arriving
    every 1.5 s, so prefills mostly run alone and the fit has points."""
    rows = []
    for k in range(32):
        family, blocks = k % 4, 2 + k % 5
        hash_ids = [1000 * family] + [1000 * family + 1 + b for b in range(blocks - 1)]
        rows.append({"timestamp": 1500 * k, "input_length": 512 * blocks - 100, "output_length": 12,
                     "hash_ids": hash_ids})
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def trace_run(trace_path: Path, recorded_engines: bool = True) -> dict:
    """A measure_trace.py results.json without requests yet."""
    trace = sample(trace_path)
    blocks = int(kv_cache_tokens(KV_CACHE_GIB, "float32")) // SCALING.block_tokens
    results = {"workers": WORKERS, "machine": {"cpus": 2}, "summaries": {}, "requests": [],
               "settings": {"family_fraction": 1.0, "kv_cache_gib_used": KV_CACHE_GIB, "dtype": "float32"},
               "trace": {"path": str(trace_path), "scaling": vars(SCALING), "kept": trace.kept,
                         "dropped": trace.dropped, "kv_cache_blocks_per_worker": blocks,
                         "bounds": trace_bounds(trace, SCALING.block_tokens, blocks * len(WORKERS), 0)}}
    if recorded_engines:
        results["workload"] = engine_record(KV_CACHE_GIB, "float32")
    return results


def sample(trace_path: Path):
    return scaled_sample(read_trace(trace_path), 1.0, SCALING)


def rows_of(policy: str, groups: dict[int, int], records) -> list[dict]:
    """What measure_trace.py and measure_placement.py record of each request (its prefix
    group under "repository"), from simulated records."""
    return [{"policy": policy, "index": r.index, "repository": groups[r.index], "scheduled_s": r.arrival_seconds,
             "sent_s": r.arrival_seconds, "status": 200, "error": None, "counted": True,
             "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens, "plan_kind": r.plan,
             "prefill_worker": r.prefill_worker if r.plan == "disagg" else None, "decode_worker": r.decode_worker,
             "prefilling_worker": r.prefill_worker, "ttft_s": r.ttft_seconds, "e2e_s": r.e2e_seconds,
             "chunk_times_s": [r.ttft_seconds, r.e2e_seconds], "response_id": r.request_id} for r in records]


def summary(rows: list[dict]) -> dict:
    ttft, cached = [row["ttft_s"] for row in rows], sum(row["cached_tokens"] for row in rows)
    return {"ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "hit_rate": cached / sum(row["prompt_tokens"] for row in rows), "cached_tokens": cached, "errors": 0}


def simulated_trace_run(folder: Path) -> Path:
    """A trace run that the simulator made, on the cluster the results describe, with its
    default curves (written as measure_trace.py writes a real one)."""
    trace_path = write_trace(folder / "trace.jsonl")
    results, trace = trace_run(trace_path), sample(trace_path)
    groups = {request.index: request.hash_ids[0] for request in trace.requests}
    simulate_into(results, trace, groups)
    shares_of_bounds(SimpleNamespace(summaries=results["summaries"]), results["trace"]["bounds"])
    return written(folder, results)


def simulated_repository_run(folder: Path) -> Path:
    """A repository-assistant run that the simulator made (written as measure_placement.py
    writes a real one), on a workload small enough for a test."""
    results = {"workers": WORKERS, "machine": {"cpus": 2}, "summaries": {}, "requests": [],
               "settings": {"kv_cache_gib_used": KV_CACHE_GIB, "dtype": "float32"},
               "workload": {"config": asdict(REPOSITORY)} | engine_record(KV_CACHE_GIB, "float32")}
    requests, groups = repository_requests(results)
    simulate_into(results, requests, groups)
    return written(folder, results)


def simulate_into(results: dict, requests, groups: dict[int, int]) -> None:
    """Every policy of POLICIES on the cluster the results describe: rows, summaries, ratios."""
    cluster = cluster_from_replay(results)
    for policy in POLICIES:
        records = simulate(requests, policy, cluster.num_prefill, cluster.num_decode,
                           settings=cluster.settings()).records
        rows = rows_of(policy, groups, sorted(records, key=lambda r: r.index))
        results["requests"] += rows
        results["summaries"][policy] = summary(rows)
    results["ratios"] = ratios(results["summaries"])


def written(folder: Path, results: dict) -> Path:
    path = folder / "results.json"
    path.write_text(json.dumps(results))
    return path
