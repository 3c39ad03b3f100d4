"""The lookups of ``kvroute bench index``: prompts of every kind, each hashed and matched
once with cold caches, as in service, and their timings summarised."""

from __future__ import annotations

import argparse
import gc
import os
import random
import time

import numpy as np

from foundation.identity import block_hashes
from kvroute.bench.index.fleet import GROUP_DOCS, HOT_DOCS, PRIVATE, PRIVATE_TENANTS, PUBLIC, chunk, document
from orchestrator.index import PrefixIndex
from simulator.records import percentile

MIX = {"hot": 0.25, "group": 0.2, "conversation": 0.2, "private": 0.1, "miss": 0.15, "look-alike": 0.1}


def make_prompt(kind: str, fleet: dict, rng: random.Random) -> tuple[list[int], str]:
    shape = fleet["shape"]
    block_size, prompt_blocks = shape.block_size, shape.prompt_blocks
    if kind == "hot":
        return document(("hot", rng.randrange(HOT_DOCS), 0), shape), PUBLIC
    if kind == "group":
        return document(("group", rng.randrange(len(fleet["groups"])), rng.randrange(GROUP_DOCS)), shape), PUBLIC
    if kind == "conversation":
        _, doc, branch, seed = rng.choice(fleet["conversations"])
        return document(doc, shape)[:branch * block_size] + chunk(seed, prompt_blocks - branch, shape), PUBLIC
    if kind == "private":
        _, tenant, seed = rng.choice(fleet["privates"])
        return chunk(seed, prompt_blocks, shape), PRIVATE[tenant]
    if kind == "miss":
        return chunk(rng.randrange(1 << 40) + (1 << 50), prompt_blocks, shape), PUBLIC
    if kind == "look-alike":
        return document(("hot", rng.randrange(HOT_DOCS), 0), shape), PRIVATE[rng.randrange(PRIVATE_TENANTS)]
    raise ValueError(kind)


def summary(values_s: list[float]) -> dict:
    return {"n": len(values_s), "p50_us": percentile(values_s, 50) * 1e6, "p90_us": percentile(values_s, 90) * 1e6,
            "p99_us": percentile(values_s, 99) * 1e6, "max_us": max(values_s) * 1e6,
            "mean_us": float(np.mean(values_s)) * 1e6}


def measure(index: PrefixIndex, fleet: dict, args: argparse.Namespace, rng: random.Random) -> dict:
    """One timed pass per lookup: hash the prompt's blocks, then match; both cold, as in service.

    Wall-clock times are the headline. The thread's CPU time over the same region is
    recorded too: on a shared machine, a lookup preempted by other processes shows a
    long wall time but not a long CPU time.
    """
    # Small fleets (--blocks) may have no complete conversation or private chain to ask for.
    kinds = [k for k in MIX if not (k == "conversation" and not fleet["conversations"])
             and not (k == "private" and not fleet["privates"])]
    weights = [MIX[k] for k in kinds]
    parts = ("total", "hash", "match", "total_cpu")
    timings: dict[str, dict[str, list[float]]] = {k: {part: [] for part in parts} for k in kinds}
    matched_workers: dict[str, list[int]] = {k: [] for k in kinds}
    best_depth: dict[str, list[int]] = {k: [] for k in kinds}
    perf, cpu = time.perf_counter, time.thread_time
    shape = fleet["shape"]
    gc_before = [s["collections"] for s in gc.get_stats()]
    for i in range(args.warmup + args.lookups):
        kind = rng.choices(kinds, weights)[0]
        tokens, salt = make_prompt(kind, fleet, rng)
        c0 = cpu()
        t0 = perf()
        hashes = block_hashes(tokens, shape.block_size, salt)
        t1 = perf()
        result = index.match(hashes)
        t2 = perf()
        c2 = cpu()
        if kind in ("miss", "look-alike"):
            assert not result, (kind, result)
        if i < args.warmup:
            continue
        for part, value in zip(parts, (t2 - t0, t1 - t0, t2 - t1, c2 - c0)):
            timings[kind][part].append(value)
        matched_workers[kind].append(len(result))
        best_depth[kind].append(max(result.values(), default=0))
    gc_after = [s["collections"] for s in gc.get_stats()]
    every = {part: [t for k in kinds for t in timings[k][part]] for part in parts}
    return {
        "overall": {part: summary(values) for part, values in every.items()},
        "by_kind": {k: {**{part: summary(v) for part, v in timings[k].items()},
                        "matching_workers_mean": float(np.mean(matched_workers[k])),
                        "best_depth_mean": float(np.mean(best_depth[k]))}
                    for k in kinds if timings[k]["total"]},
        "gc_collections_during_lookups": [a - b for a, b in zip(gc_after, gc_before)],
        "load_average": os.getloadavg(),
    }
