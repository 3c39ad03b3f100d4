"""One request's way through the simulated cluster (``Flight``), and the record it leaves.

Single writer: the simulation loop (``simulator.loop``), which fills a flight in as the
request is placed, prefilled, handed off and decoded; ``record_of`` reads it once it ended.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from foundation import identity
from orchestrator.planner.views import Decision
from simulator.records import FINISHED, RequestRecord
from simulator.requests import ReplayRequest

PENDING, RUNNING = "pending", "running"


@dataclass(eq=False)
class Flight:
    """One request's way through the cluster. Single writer: ``Simulation``."""

    request: ReplayRequest
    request_id: str
    token_ids: list[int] | None
    block_hashes: list[identity.BlockHash]
    prompt_tokens: int
    admit_by: float
    decision: Decision | None = None
    status: str = PENDING
    tokens_out: int = 0
    prefill_started_at: float | None = None
    first_token_at: float | None = None
    second_token_at: float | None = None
    last_token_at: float | None = None
    cached_tokens: int = 0
    tier_tokens: int = 0
    tier_disk_tokens: int = 0
    tier_load_seconds: float = 0.0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0

    @property
    def plan(self):
        return self.decision.chosen if self.decision else None

    @property
    def prefilling_worker(self) -> str:
        return self.plan.prefill_worker or self.plan.decode_worker


def record_of(flight: Flight) -> RequestRecord:
    request, plan = flight.request, flight.plan
    record = RequestRecord(request_id=flight.request_id, index=request.index,
                           arrival_seconds=request.arrival_seconds, status=flight.status,
                           prompt_tokens=flight.prompt_tokens, output_tokens=flight.tokens_out)
    if flight.status != FINISHED:
        return record
    arrival, estimate = request.arrival_seconds, plan.estimate
    gap = None if flight.second_token_at is None else flight.second_token_at - flight.first_token_at
    return replace(record, plan=plan.kind.value, prefill_worker=flight.prefilling_worker,
                   decode_worker=plan.decode_worker, cached_tokens=flight.cached_tokens,
                   tier_tokens=flight.tier_tokens, tier_disk_tokens=flight.tier_disk_tokens,
                   tier_load_seconds=flight.tier_load_seconds,
                   predicted_reused_tokens=estimate.reused_tokens if estimate else 0,
                   predicted_tier_tokens=estimate.tier_tokens if estimate else 0,
                   estimated_ttft_seconds=estimate.ttft if estimate else None,
                   queue_seconds=flight.prefill_started_at - arrival,
                   ttft_seconds=flight.first_token_at - arrival, second_token_gap_seconds=gap,
                   e2e_seconds=flight.last_token_at - arrival, transfer_bytes=flight.transfer_bytes,
                   transfer_seconds=flight.transfer_seconds)
