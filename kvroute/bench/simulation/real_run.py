"""The real run that ``kvroute bench validate-simulator`` (and the results page) compares
the simulator with: its results, its requests rebuilt exactly, its P50's uncertainty."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvroute.bench.placement.cluster import engine_record
from kvroute.bench.placement.trace import scaled_sample
from simulator.from_replay import read_decisions
from simulator.requests import replay_requests
from workloads import RepositoryAssistantConfig, generate_workload, load_tokenizer, tokenizer_counter
from workloads.trace import TraceScaling, read_trace

BOOTSTRAP_SAMPLES = 2000


def is_trace_run(results: dict) -> bool:
    """Written by ``kvroute bench trace`` (else by ``kvroute bench placement``)."""
    return "trace" in results


def load_real(path: Path) -> tuple[dict, list[dict], list[str]]:
    results = json.loads(path.read_text())
    if is_trace_run(results) and "workload" not in results:
        # Trace runs made before they recorded their engines ran the workers' defaults of now.
        results["workload"] = engine_record(results["settings"]["kv_cache_gib_used"], results["settings"]["dtype"])
    serve_log = path.parent / "serve.log"
    decisions = read_decisions(serve_log) if serve_log.exists() else []
    logs = [log.read_text(errors="replace") for log in sorted((path.parent / "workers").glob("*.log"))]
    return results, decisions, logs


def rebuild_requests(results: dict):
    """The run's requests as token ids, and how they compare with its rows."""
    requests, groups = trace_requests(results) if is_trace_run(results) else repository_requests(results)
    by_index = {request.index: request for request in requests}
    checked = mismatched = 0
    for row in results["requests"]:
        request = by_index.get(row["index"])
        checked += 1
        if (request is None or request.prompt_tokens != row["prompt_tokens"]
                or abs(request.arrival_seconds - row["scheduled_s"]) > 1e-6
                or groups[row["index"]] != row["repository"]):
            mismatched += 1
    return requests, {"rows_checked": checked, "rows_mismatched": mismatched, "requests": len(requests)}


def repository_requests(results: dict):
    """The repository-assistant requests, templated by the model's tokenizer, and their repositories."""
    tokenizer = load_tokenizer()
    config = RepositoryAssistantConfig(**results["workload"]["config"])
    workload = generate_workload(config, tokenizer_counter(tokenizer))
    return replay_requests(workload, tokenizer), {item.index: item.repository for item in workload}


def trace_requests(results: dict):
    """The trace sample, scaled as the run scaled it, and each request's first block id
    (what the run recorded as its prefix group)."""
    trace = scaled_sample(read_trace(results["trace"]["path"]), results["settings"]["family_fraction"],
                          TraceScaling(**results["trace"]["scaling"]))
    return replay_requests(trace), {request.index: request.hash_ids[0] for request in trace.requests}


def real_p50_interval(rows: list[dict], seed: int = 0) -> tuple[float, float]:
    """5th and 95th percentile of the P50 TTFT over bootstrap resamples of the requests."""
    ttft = np.array([row["ttft_s"] for row in rows])
    draws = np.random.default_rng(seed).choice(ttft, size=(BOOTSTRAP_SAMPLES, len(ttft)))
    medians = np.percentile(draws, 50, axis=1)
    return float(np.percentile(medians, 5)), float(np.percentile(medians, 95))
