"""Operator views of and actions across the fleet."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import msgspec

from foundation.wire import ROLES
from orchestrator.circuit_breaker import BreakerState
from orchestrator.fleet import Fleet
from orchestrator.index import PrefixIndex
from orchestrator.index_sync import IndexSync
from orchestrator.worker_client import WorkerError


def describe_workers(fleet: Fleet, index: PrefixIndex, prefill_speed: Mapping[str, float] | None = None) -> list[dict]:
    """The workers as the orchestrator sees them (operators, tests, dashboards): those in
    rotation, then those draining, which still finish their requests until they stop.
    ``prefill_speed``: the cost model's measured speeds (None for a worker not yet measured)."""
    prefill_speed = prefill_speed or {}
    return [{"worker_id": w.worker_id, "role": w.role, "incarnation": w.incarnation,
             "rpc_address": w.rpc_address, "transfer_address": w.transfer_address, "draining": w.draining,
             "in_flight": fleet.in_flight(w.worker_id), "index_blocks": index.num_blocks(w.worker_id),
             "prefill_speed": prefill_speed.get(w.worker_id), "cores": msgspec.to_builtins(w.cores),
             "load": msgspec.to_builtins(w.load)}
            for role in ROLES for w in (*fleet.live(role), *fleet.draining(role))]


def describe_unavailable(fleet: Fleet, now: float) -> list[dict]:
    """Heartbeating workers that ``describe_workers`` leaves out because a fault took them out
    of rotation: their RPC connection broke, or their circuit breaker is not closed (open, or
    half-open with its probe request running)."""
    shown = {w.worker_id for role in ROLES for w in (*fleet.live(role), *fleet.draining(role))}
    breakers = fleet.breakers.states(now)
    return [{"worker_id": w.worker_id, "role": w.role, "draining": w.draining,
             "reason": _why_unavailable(fleet, w.worker_id, breakers.get(w.worker_id))}
            for role in ROLES for w in fleet.registry.live(role) if w.worker_id not in shown]


def _why_unavailable(fleet: Fleet, worker_id: str, breaker: BreakerState | None) -> str:
    client = fleet.client(worker_id)
    if client is None or client.connection_lost:
        return "unreachable"
    if breaker is BreakerState.HALF_OPEN:
        return "breaker half-open, probing"
    return "breaker open" if breaker is BreakerState.OPEN else "out of rotation"


async def reset_all_caches(fleet: Fleet, index_sync: IndexSync, roles: tuple[str, ...] = ROLES) -> list[dict]:
    """Release every held lease, empty the prefix cache of every worker in ``roles`` and the
    node store each uses, then reload the index.

    For fair side-by-side policy experiments on one running cluster: each run starts cold.
    Resetting the decode workers alone keeps the prefill workers' prefixes, so that moving
    a prompt's KV can be compared with recomputing it on a cold decode worker.
    """
    workers = [w for role in roles for w in fleet.live(role)]
    results = await asyncio.gather(*(_reset(fleet, w.worker_id) for w in workers))
    for worker in workers:
        index_sync.request_resync(worker.worker_id)
    return results


async def _reset(fleet: Fleet, worker_id: str) -> dict:
    client = fleet.client(worker_id)
    if client is None:
        return {"worker_id": worker_id, "reset": False, "error": "worker went away"}
    try:
        reply = await client.reset_cache()
    except WorkerError as error:
        return {"worker_id": worker_id, "reset": False, "error": str(error)}
    result = {"worker_id": worker_id, "reset": reply.reset, "released_leases": reply.released_leases}
    if reply.store_blocks_dropped or reply.store_error:  # its node store, emptied with it (or not reached)
        result |= {"store_blocks_dropped": reply.store_blocks_dropped, "store_error": reply.store_error}
    return result
