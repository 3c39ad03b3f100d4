"""Benchmark the prefix index: longest-prefix lookup of an 8k-token prompt over 64 workers.

The index (``orchestrator.index.PrefixIndex``) is populated the way it is in service:
through ``apply()`` of vLLM-shaped ``BlockStored`` events, one per stored chain, with
per-worker engine hashes. The fleet (defaults) holds about one million block entries:

* 64 workers in 8 groups of 8; one public tenant, 4 private tenants;
* a public system prompt (2,048 tokens: 16 blocks of 128) on every worker;
* 16 "hot" documents continuing the system prompt to 8,192 tokens (64 blocks), on every
  worker, each worker holding each to its own depth (16..64 blocks);
* per group 64 documents continuing the system prompt, on the group's 8 workers, each
  to its own depth;
* the rest per worker: unique conversations branching off a document it holds at some
  depth and continuing to 64 blocks (75%), and private-tenant chains of 64 blocks (25%).

Block counts are for the default ``--block-size`` of 128; at another size the token
lengths stay and the counts follow (at 32: 64 system blocks, 256-block prompts), while
``--blocks`` still counts block entries.

Lookups (``--lookups``, default 2,000) use 8,192-token prompts (64 blocks of 128), a mix of

* ``hot``: system prompt + a hot document: matches on all 64 workers, at varied depths;
* ``group``: system prompt + a group document: 16 blocks on all, deeper on 8;
* ``conversation``: one worker's conversation: 64 blocks on one worker, shorter on others;
* ``private``: a private tenant's chain: 64 blocks on one worker;
* ``miss``: fresh tokens: nothing matches;
* ``look-alike``: a hot prompt's tokens under another tenant's salt: nothing matches.

Each lookup times, in one pass with cold caches as in service, hashing the prompt's
blocks and matching (``total``), and within it the hashing and the match alone; and the
thread's CPU time over the whole (``CPU``: what the lookup costs when it is not preempted
by other processes). Target: p99 of ``total`` ≤ 1 ms. Memory is the
growth of the process RSS while populating (``--tracemalloc`` adds Python's own
accounting of the populated index, at a large cost in build time).

Usage::

    .venv/bin/python scripts/bench_index.py [--output DIR] [--lookups N] [--blocks N] [--workers N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
import tracemalloc
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the project is run from its checkout, not installed
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from foundation.identity import Namespace, block_hashes  # noqa: E402
from foundation.kv_events import BlockStored  # noqa: E402
from orchestrator.index import PrefixIndex  # noqa: E402

console = Console(width=int(os.environ.get("COLUMNS", "140")))

TARGET_P99_S = 0.001
PROMPT_TOKENS = 8192
SYSTEM_TOKENS = 2048
# Set from --block-size by use_block_size(); the fleet's shape is in blocks of this size.
BLOCK_SIZE = 128
PROMPT_BLOCKS = PROMPT_TOKENS // BLOCK_SIZE
SYSTEM_BLOCKS = SYSTEM_TOKENS // BLOCK_SIZE
HOT_DOCS = 16
GROUP_DOCS = 64
PRIVATE_TENANTS = 4
PRIVATE_SHARE = 0.25
VOCAB = 49_152
MODEL = "bench-model@rev1"
PUBLIC = Namespace(MODEL, tenant="public").cache_salt()
PRIVATE = [Namespace(MODEL, tenant=f"tenant-{i}").cache_salt() for i in range(PRIVATE_TENANTS)]
MIX = {"hot": 0.25, "group": 0.2, "conversation": 0.2, "private": 0.1, "miss": 0.15, "look-alike": 0.1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("results/bench_index"),
                        help="directory for results.json (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="block entries over all workers (default: %(default)s)")
    parser.add_argument("--lookups", type=int, default=2000, help="timed lookups (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                        help="tokens per block; the prompt stays 8,192 tokens (default: %(default)s)")
    parser.add_argument("--tracemalloc", action="store_true", help="also trace Python allocations while populating (slow)")
    return parser.parse_args(argv)


def use_block_size(size: int) -> None:
    """The prompt and the system prompt keep their token lengths; their block counts follow."""
    global BLOCK_SIZE, PROMPT_BLOCKS, SYSTEM_BLOCKS
    if size < 1 or SYSTEM_TOKENS % size:
        raise SystemExit(f"--block-size must divide {SYSTEM_TOKENS}, got {size}")
    BLOCK_SIZE, PROMPT_BLOCKS, SYSTEM_BLOCKS = size, PROMPT_TOKENS // size, SYSTEM_TOKENS // size


def results_path(output: Path) -> Path:
    return output if output.suffix == ".json" else output / "results.json"


# ---------------------------------------------------------------- token content


def chunk(seed: int, n_blocks: int) -> list[int]:
    """Deterministic token ids of ``n_blocks`` blocks, regenerated on demand (never stored)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, VOCAB, n_blocks * BLOCK_SIZE, dtype=np.int64).tolist()


SYSTEM_SEED = 1


def hot_seed(h: int) -> int:
    return 1_000 + h


def group_seed(g: int, k: int) -> int:
    return 10_000 + g * 1_000 + k


def unique_seed(w: int, j: int) -> int:
    return 10_000_000 + w * 100_000 + j


def document(doc: tuple[str, int, int]) -> list[int]:
    """System prompt + document continuation: one whole prompt."""
    kind, a, b = doc
    seed = hot_seed(a) if kind == "hot" else group_seed(a, b)
    return chunk(SYSTEM_SEED, SYSTEM_BLOCKS) + chunk(seed, PROMPT_BLOCKS - SYSTEM_BLOCKS)


# ---------------------------------------------------------------- population


class WorkerWriter:
    """Emits one worker's BlockStored events, with its own engine hashes (ints, as vLLM's may be)."""

    def __init__(self, index: PrefixIndex, worker_id: str, base: int):
        self.index = index
        self.worker_id = worker_id
        self.next_hash = base
        self.blocks = 0

    def store(self, token_ids: list[int], parent: int | None, salt: str | None) -> list[int]:
        n = len(token_ids) // BLOCK_SIZE
        hashes = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        extra = [[salt]] + [None] * (n - 1) if parent is None and salt else None
        self.index.apply(self.worker_id, BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                                     token_ids=token_ids, block_size=BLOCK_SIZE, medium="GPU",
                                                     extra_keys=extra))
        self.blocks += n
        return hashes


def populate(index: PrefixIndex, args: argparse.Namespace, rng: random.Random) -> dict:
    workers = [f"w{i:02d}" for i in range(args.workers)]
    groups = [workers[i:i + args.group_size] for i in range(0, len(workers), args.group_size)]
    per_worker = args.blocks // len(workers)
    system = chunk(SYSTEM_SEED, SYSTEM_BLOCKS)
    hot_tails = [chunk(hot_seed(h), PROMPT_BLOCKS - SYSTEM_BLOCKS) for h in range(HOT_DOCS)]
    conversations: list[tuple[str, tuple[str, int, int], int, int]] = []  # worker, doc, branch depth, seed
    privates: list[tuple[str, int, int]] = []  # worker, tenant, seed
    held_depths: dict[str, dict[tuple[str, int, int], int]] = {}

    for g, members in enumerate(groups):
        group_tails = [chunk(group_seed(g, k), PROMPT_BLOCKS - SYSTEM_BLOCKS) for k in range(GROUP_DOCS)]
        for w in members:
            index.reset_worker(w, f"{w}-incarnation")
            writer = WorkerWriter(index, w, base=(int(w[1:]) + 1) << 40)
            sys_hashes = writer.store(system, None, PUBLIC)
            docs: dict[tuple[str, int, int], tuple[int, list[int]]] = {}  # doc -> (depth, engine hashes)
            for kind, tails in (("hot", hot_tails), ("group", group_tails)):
                for k, tail in enumerate(tails):
                    depth = rng.randint(SYSTEM_BLOCKS, PROMPT_BLOCKS)
                    hashes = sys_hashes + (writer.store(tail[:(depth - SYSTEM_BLOCKS) * BLOCK_SIZE], sys_hashes[-1], None)
                                           if depth > SYSTEM_BLOCKS else [])
                    docs[(kind, k, 0) if kind == "hot" else (kind, g, k)] = (depth, hashes)
            held_depths[w] = {doc: depth for doc, (depth, _) in docs.items()}
            doc_keys = list(docs)
            j = 0
            private_budget = int((per_worker - writer.blocks) * PRIVATE_SHARE)
            while writer.blocks < per_worker:
                j += 1
                seed = unique_seed(int(w[1:]), j)
                room = per_worker - writer.blocks
                if private_budget > 0:
                    tenant = rng.randrange(PRIVATE_TENANTS)
                    n = min(PROMPT_BLOCKS, room)
                    writer.store(chunk(seed, n), None, PRIVATE[tenant])
                    private_budget -= n
                    if n == PROMPT_BLOCKS:
                        privates.append((w, tenant, seed))
                    continue
                doc = rng.choice(doc_keys)
                depth, hashes = docs[doc]
                branch = rng.randint(SYSTEM_BLOCKS, depth)
                n = min(PROMPT_BLOCKS - branch, room)
                if n <= 0:
                    continue
                writer.store(chunk(seed, n), hashes[branch - 1], None)
                if n == PROMPT_BLOCKS - branch:
                    conversations.append((w, doc, branch, seed))
    return {"workers": workers, "groups": groups, "conversations": conversations, "privates": privates,
            "held_depths": held_depths}


# ---------------------------------------------------------------- lookups


def make_prompt(kind: str, fleet: dict, rng: random.Random) -> tuple[list[int], str]:
    if kind == "hot":
        return document(("hot", rng.randrange(HOT_DOCS), 0)), PUBLIC
    if kind == "group":
        return document(("group", rng.randrange(len(fleet["groups"])), rng.randrange(GROUP_DOCS))), PUBLIC
    if kind == "conversation":
        _, doc, branch, seed = rng.choice(fleet["conversations"])
        return document(doc)[:branch * BLOCK_SIZE] + chunk(seed, PROMPT_BLOCKS - branch), PUBLIC
    if kind == "private":
        _, tenant, seed = rng.choice(fleet["privates"])
        return chunk(seed, PROMPT_BLOCKS), PRIVATE[tenant]
    if kind == "miss":
        return chunk(rng.randrange(1 << 40) + (1 << 50), PROMPT_BLOCKS), PUBLIC
    if kind == "look-alike":
        return document(("hot", rng.randrange(HOT_DOCS), 0)), PRIVATE[rng.randrange(PRIVATE_TENANTS)]
    raise ValueError(kind)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


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
    gc_before = [s["collections"] for s in gc.get_stats()]
    for i in range(args.warmup + args.lookups):
        kind = rng.choices(kinds, weights)[0]
        tokens, salt = make_prompt(kind, fleet, rng)
        c0 = cpu()
        t0 = perf()
        hashes = block_hashes(tokens, BLOCK_SIZE, salt)
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


# ---------------------------------------------------------------- memory and report


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def index_shape(index: PrefixIndex) -> dict:
    owners = index._owners
    sizes = np.fromiter((mask.bit_count() for mask in owners.values()), dtype=np.int64, count=len(owners))
    entries = sum(len(e.ours) for e in index._workers.values())
    return {"block_entries": entries, "distinct_block_hashes": len(owners),
            "owners_per_hash_mean": float(sizes.mean()) if len(sizes) else 0.0,
            "owners_per_hash_max": int(sizes.max()) if len(sizes) else 0,
            "hashes_shared_by_8_or_more": int((sizes >= 8).sum()),
            "orphans": sum(e.orphans for e in index._workers.values())}


def print_report(results: dict) -> None:
    shape, mem = results["index"], results["memory"]
    console.print(f"index: {results['config']['workers']} workers, {shape['block_entries']:,} block entries, "
                  f"{shape['distinct_block_hashes']:,} distinct hashes (mean {shape['owners_per_hash_mean']:.2f} "
                  f"owners, max {shape['owners_per_hash_max']}), built in {results['build_s']:.1f} s")
    console.print(f"memory: RSS +{mem['rss_growth_bytes'] / 2**20:,.0f} MiB while populating "
                  f"({mem['rss_growth_bytes'] / max(shape['block_entries'], 1):.0f} B per entry)"
                  + (f"; tracemalloc {mem['tracemalloc_bytes'] / 2**20:,.0f} MiB" if "tracemalloc_bytes" in mem else ""))
    table = Table(title=f"lookup of an {PROMPT_BLOCKS * BLOCK_SIZE:,}-token prompt ({PROMPT_BLOCKS} blocks), µs")
    for column in ("prompts", "n", "workers matched", "best depth", "total p50", "total p99", "total max",
                   "hash p50", "hash p99", "match p50", "match p99", "CPU p50", "CPU p99"):
        table.add_column(column, justify="right" if column != "prompts" else "left")
    m = results["measurements"]
    rows = [(k, v) for k, v in m["by_kind"].items()] + [("all", m["overall"])]
    for name, row in rows:
        table.add_row(name, str(row["total"]["n"]),
                      f"{row['matching_workers_mean']:.1f}" if name != "all" else "",
                      f"{row['best_depth_mean']:.1f}" if name != "all" else "",
                      *(f"{row[part][stat]:.0f}" for part, stat in (
                          ("total", "p50_us"), ("total", "p99_us"), ("total", "max_us"), ("hash", "p50_us"),
                          ("hash", "p99_us"), ("match", "p50_us"), ("match", "p99_us"), ("total_cpu", "p50_us"),
                          ("total_cpu", "p99_us"))))
    console.print(table)
    p99 = m["overall"]["total"]["p99_us"]
    verdict = "MET" if results["target_met"] else "NOT MET"
    console.print(f"target p99(hash+match, wall) ≤ {TARGET_P99_S * 1e6:.0f} µs: {verdict} (p99 {p99:.0f} µs; "
                  f"CPU-time p99 {m['overall']['total_cpu']['p99_us']:.0f} µs: "
                  f"{'MET' if results['target_met_cpu'] else 'NOT MET'}); GC collections during lookups "
                  f"{m['gc_collections_during_lookups']}; load average {', '.join(f'{x:.1f}' for x in m['load_average'])}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_block_size(args.block_size)
    out_file = results_path(args.output)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)

    gc.collect()
    rss_before = rss_bytes()
    if args.tracemalloc:
        tracemalloc.start()
    index = PrefixIndex()
    started = time.perf_counter()
    fleet = populate(index, args, rng)
    build_s = time.perf_counter() - started
    memory = {}
    if args.tracemalloc:
        traced = tracemalloc.get_traced_memory()[0]
        catalogue = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, __file__)])
        memory["tracemalloc_catalogue_bytes"] = sum(stat.size for stat in catalogue.statistics("filename"))
        memory["tracemalloc_bytes"] = traced - memory["tracemalloc_catalogue_bytes"]  # the index alone
        tracemalloc.stop()
    gc.collect()
    memory["rss_before_bytes"] = rss_before
    memory["rss_after_bytes"] = rss_bytes()
    memory["rss_growth_bytes"] = memory["rss_after_bytes"] - rss_before
    shape = index_shape(index)
    console.print(f"populated {shape['block_entries']:,} entries in {build_s:.1f} s; measuring {args.lookups} lookups")

    measurements = measure(index, fleet, args, rng)
    results = {
        "config": {"workers": args.workers, "group_size": args.group_size, "blocks_target": args.blocks,
                   "block_size": BLOCK_SIZE, "prompt_blocks": PROMPT_BLOCKS, "system_blocks": SYSTEM_BLOCKS,
                   "hot_docs": HOT_DOCS, "group_docs": GROUP_DOCS, "private_share": PRIVATE_SHARE,
                   "lookups": args.lookups, "warmup": args.warmup, "mix": MIX, "seed": args.seed},
        "environment": {"python": platform.python_version(), "platform": platform.platform(),
                        "cpus": os.cpu_count(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        "build_s": build_s,
        "index": shape,
        "memory": memory,
        "measurements": measurements,
        "target_p99_us": TARGET_P99_S * 1e6,
        "target_met": measurements["overall"]["total"]["p99_us"] <= TARGET_P99_S * 1e6,
        "target_met_cpu": measurements["overall"]["total_cpu"]["p99_us"] <= TARGET_P99_S * 1e6,
    }
    out_file.write_text(json.dumps(results, indent=2))
    print_report(results)
    console.print(f"results: {out_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
