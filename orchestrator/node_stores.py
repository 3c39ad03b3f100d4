"""The node KV stores behind the workers (``transfer.node_store``), as operators see them
(``GET /admin/stores``).

The orchestrator has no line to a store: a store listens on its host's loopback only, and
each worker that uses one reports its counters in its stats. Workers on one host share their
store, so the view is one entry per store (its node: the host of the workers' RPC addresses;
the store's address there), with the workers that reported it; a store no worker could reach is
listed with why. ``indexed`` is what the orchestrator's own view of the store holds per tier
(``orchestrator.tier_holdings``), which the planner prices: it follows the store's counts
within a poll, and is empty for a store it cannot follow.
"""

from __future__ import annotations

import asyncio

from foundation import wire
from orchestrator.fleet import Fleet
from orchestrator.registry import node_store_key
from orchestrator.tier_holdings import DISK, HOST, TierHoldings
from orchestrator.worker_client import WorkerError

STATS_TIMEOUT_SECONDS = 5.0


async def describe_stores(fleet: Fleet, tiers: TierHoldings) -> list[dict]:
    workers = [w for role in wire.ROLES for w in (*fleet.live(role), *fleet.draining(role))]
    replies = await asyncio.gather(*(_stats(fleet, w.worker_id) for w in workers))
    stores: dict[tuple[str, str], dict] = {}
    for worker, stats in zip(workers, replies):
        if stats is None or not stats.node_store_address:
            continue
        key = node_store_key(worker.rpc_address, stats.node_store_address)
        entry = stores.setdefault(key, {"node": key[0], "address": key[1], "workers": [], "reachable": False,
                                        "error": stats.node_store_error,
                                        "indexed": {tier: tiers.num_blocks(key, tier) for tier in (HOST, DISK)}})
        entry["workers"].append(worker.worker_id)
        if stats.node_store is not None and not entry["reachable"]:
            entry.update(reachable=True, error="", **describe_counters(stats.node_store))
    return list(stores.values())


def describe_counters(counters: wire.TierCounters) -> dict:
    """Capacity and use per tier, the lookups' hit rate over blocks asked, and what left each tier."""
    return {
        "block_bytes": counters.block_bytes,
        "tiers": {"host": {"blocks": counters.host_blocks, "capacity": counters.host_capacity,
                           "bytes": counters.host_blocks * counters.block_bytes},
                  "disk": {"blocks": counters.disk_blocks, "capacity": counters.disk_capacity,
                           "bytes": counters.disk_blocks * counters.block_bytes}},
        "lookups": counters.lookups, "lookup_blocks": counters.lookup_blocks, "lookup_hits": counters.lookup_hits,
        "hit_rate": counters.lookup_hits / counters.lookup_blocks if counters.lookup_blocks else None,
        "blocks_stored": counters.blocks_stored, "blocks_served": counters.blocks_served,
        # Evictions: host blocks moved to disk, and blocks gone from the last tier.
        "demotions": counters.demotions, "dropped": counters.dropped, "promotions": counters.promotions,
        "corrupt_blocks": counters.corrupt_blocks, "resets": counters.resets,
    }


async def _stats(fleet: Fleet, worker_id: str) -> wire.WorkerStats | None:
    client = fleet.client(worker_id)
    if client is None:
        return None
    try:
        return await client.stats(timeout=STATS_TIMEOUT_SECONDS)
    except WorkerError:
        return None
