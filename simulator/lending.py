"""A PULL plan in the simulation: a unified worker takes a cached prefix from another worker.

As ``orchestrator.disagg.generate_pulled`` drives it in service::

    source: prompt[:lend] (max_tokens=1, blocks held) ─▶ lent; its token is dropped
      ─▶ the lent blocks the sink lacks move over the sink's link (``Links``)
      ─▶ they join the sink's prefix cache (``take_lent_blocks``)
    sink:   the whole prompt, as a LOCAL request: hits the lent blocks, computes the rest, decodes

One simplification, against kvroute's connector: the connector allocates the sink's blocks
when the sink admits the request and pulls into them; here the blocks land first, as
cached blocks no request holds yet (as if a request had just released them), and the
request is submitted when they have. A sink with too few free blocks takes the leading
blocks that fit and computes the rest, as a pull that found no room recomputes.

The lend is its own engine request (``lend_request_id``), so the loop tells its token from
the request's own.
"""

from __future__ import annotations

from orchestrator.planner.views import Plan
from simulator.block_pool import publish_stored
from simulator.engine import Engine
from simulator.flight import Flight
from simulator.sequence import EngineRequest

LEND_SUFFIX = "-lend"


def lend_request_id(request_id: str) -> str:
    return request_id + LEND_SUFFIX


def lend_request(flight: Flight, plan: Plan, block_size: int) -> EngineRequest:
    """What the source computes: the lent leading blocks, one token, its blocks held for the pull."""
    blocks = plan.lend_tokens // block_size
    return EngineRequest(lend_request_id(flight.request_id), flight.token_ids[:plan.lend_tokens],
                         flight.block_hashes[:blocks], max_tokens=1, hold_blocks=True)


def lent_blocks_missing(sink: Engine, flight: Flight, plan: Plan) -> int:
    """Lent blocks the sink does not hold: what moves over its link."""
    keys = flight.block_hashes[:plan.lend_tokens // sink.config.block_size]
    return len(keys) - sink.pool.cached_prefix(keys, len(keys))


def take_lent_blocks(sink: Engine, flight: Flight, plan: Plan) -> int:
    """The lent blocks the sink lacks join its prefix cache, unheld, published as stored; as
    many leading ones as its free blocks allow. How many joined."""
    pool, size = sink.pool, sink.config.block_size
    keys = flight.block_hashes[:plan.lend_tokens // size]
    held = keys[:pool.cached_prefix(keys, len(keys))]
    room = pool.num_free - pool.blocks_to_admit(held, 0)
    missing = keys[len(held):len(held) + max(0, room)]
    pool.acquire(held)  # the prefix they extend must not be evicted to make room for them
    pool.allocate(len(missing))
    table = [key if pool.promote(key) else None for key in missing]  # None: cached already, a private copy
    pool.release([*held, *table])
    publish_stored(pool, keys, flight.token_ids, len(held), len(held) + len(missing), size)
    return len(missing)
