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

    kvroute bench index [--output DIR] [--lookups N] [--blocks N] [--workers N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import time
import tracemalloc
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvroute.bench.command import Command
from kvroute.bench.index import fleet as fleet_module
from kvroute.bench.index.fleet import DEFAULT_BLOCK_SIZE, GROUP_DOCS, HOT_DOCS, PRIVATE_SHARE, Shape, populate
from kvroute.bench.index.lookups import MIX, measure
from kvroute.bench.paths import results_path
from kvroute.bench.progress import Bar
from orchestrator.index import PrefixIndex

console = Console(width=int(os.environ.get("COLUMNS", "140")))

TARGET_P99_S = 0.001


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, default=Path("results/bench_index"),
                        help="directory for results.json (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=1_000_000,
                        help="block entries over all workers (default: %(default)s)")
    parser.add_argument("--lookups", type=int, default=2000, help="timed lookups (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                        help="tokens per block; the prompt stays 8,192 tokens (default: %(default)s)")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="also trace Python allocations while populating (slow)")


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
                  + (f"; tracemalloc {mem['tracemalloc_bytes'] / 2**20:,.0f} MiB"
                     if "tracemalloc_bytes" in mem else ""))
    config = results["config"]
    table = Table(title=f"lookup of an {config['prompt_blocks'] * config['block_size']:,}-token prompt "
                        f"({config['prompt_blocks']} blocks), µs")
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
                  f"{m['gc_collections_during_lookups']}; load average "
                  f"{', '.join(f'{x:.1f}' for x in m['load_average'])}")


def run(args: argparse.Namespace) -> int:
    sizes = Shape(args.block_size)
    out_file = results_path(args.output)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)

    gc.collect()
    rss_before = rss_bytes()
    if args.tracemalloc:
        tracemalloc.start()
    index = PrefixIndex()
    # Two steps, not a bar per lookup, and nothing redrawn meanwhile: it would be timed with the lookups.
    with Bar(console, "index", 2, redraw=False) as phase:
        phase.step(f"populate {args.blocks:,} block entries")
        started = time.perf_counter()
        fleet = populate(index, args, rng, sizes)
        build_s = time.perf_counter() - started
        memory = measured_memory(args, rss_before)
        shape = index_shape(index)
        console.print(f"populated {shape['block_entries']:,} entries in {build_s:.1f} s; "
                      f"measuring {args.lookups} lookups")
        phase.step(f"{args.lookups:,} lookups")
        measurements = measure(index, fleet, args, rng)
    results = {
        "config": {"workers": args.workers, "group_size": args.group_size, "blocks_target": args.blocks,
                   "block_size": sizes.block_size, "prompt_blocks": sizes.prompt_blocks,
                   "system_blocks": sizes.system_blocks,
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
    return 0


def measured_memory(args: argparse.Namespace, rss_before: int) -> dict:
    """What populating the index cost: RSS growth, and with --tracemalloc Python's own count."""
    memory = {}
    if args.tracemalloc:
        traced = tracemalloc.get_traced_memory()[0]
        # What the fleet's own code holds (its catalogue of prompts, the token lists it made), not the index.
        catalogue = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, fleet_module.__file__)])
        memory["tracemalloc_catalogue_bytes"] = sum(stat.size for stat in catalogue.statistics("filename"))
        memory["tracemalloc_bytes"] = traced - memory["tracemalloc_catalogue_bytes"]  # the index alone
        tracemalloc.stop()
    gc.collect()
    memory["rss_before_bytes"] = rss_before
    memory["rss_after_bytes"] = rss_bytes()
    memory["rss_growth_bytes"] = memory["rss_after_bytes"] - rss_before
    return memory


COMMAND = Command("index", "the prefix index: longest-prefix lookup of an 8k-token prompt over 64 workers", __doc__,
                  add_arguments, run)
parse_args, main = COMMAND.parse_args, COMMAND.main
