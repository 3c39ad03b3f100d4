"""Decision records: for every request, what the planner expected, what happened, and why.

A record is written when the request is placed (estimates, alternatives, reason) and
completed when it finishes (actual reused tokens and latencies). Recent records stay in
memory for ``GET /v1/decisions``; every completed record is also logged as one JSON line
on the ``kvroute.decisions`` logger. A record carries the tenant whose request it
explains: a tenant's key reads its own records only, an admin key reads all.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import msgspec

from orchestrator.planner.views import Decision, Plan

if TYPE_CHECKING:
    from orchestrator.disagg import HandoffRecord

logger = logging.getLogger("kvroute.decisions")
_record_encoder = msgspec.json.Encoder(enc_hook=str)  # dataclasses natively; anything odd as text


def plan_summary(plan: Plan) -> dict:
    summary = {"kind": plan.kind.value, "prefill_worker": plan.prefill_worker, "decode_worker": plan.decode_worker,
               "feasible": plan.feasible}
    if plan.source_worker:
        summary["source_worker"], summary["lend_tokens"] = plan.source_worker, plan.lend_tokens
    if plan.infeasible_reason:
        summary["infeasible_reason"] = plan.infeasible_reason
    if plan.estimate is not None:
        summary["estimate"] = plan.estimate  # frozen; to_dict() and the log encoder expand it
    return summary


@dataclass
class Actual:
    reused_tokens: int | None = None  # prompt tokens the prefilling engine did not compute
    tier_tokens: int | None = None  # of those, the ones it loaded from its node KV store
    tier_seconds: float | None = None  # what loading them took, from the store's lookup on
    ttft: float | None = None
    second_token_gap: float | None = None
    e2e: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    transfer_bytes: int | None = None
    transfer_seconds: float | None = None
    # Seconds the prefill stalled the streams decoding on its worker, summed over the
    # ``stalled_streams`` measured (``orchestrator.decode_streams``); None: none measured.
    stall_seconds: float | None = None
    stalled_streams: int | None = None

    def observe(self, handoff: HandoffRecord, arrived_at: float, now: float) -> None:
        """What the request's hand-off record says happened: its reuse, latencies and pull."""
        if handoff.first_token_at is not None:
            self.reused_tokens, self.tier_tokens = handoff.prefill_cached_tokens, handoff.prefill_tier_tokens
            if handoff.prefill_tier_tokens:
                self.tier_seconds = handoff.prefill_tier_seconds
            self.ttft = handoff.first_token_at - arrived_at
            self.e2e = now - arrived_at
        if handoff.second_token_at is not None:
            self.second_token_gap = handoff.second_token_at - handoff.first_token_at
        if handoff.transfer is not None and handoff.transfer.ok:
            self.transfer_bytes, self.transfer_seconds = handoff.transfer.num_bytes, handoff.transfer.seconds
        if handoff.prefill_stall is not None:
            self.stall_seconds, self.stalled_streams = handoff.prefill_stall.seconds, handoff.prefill_stall.streams


@dataclass
class DecisionRecord:
    response_id: str
    choice_index: int
    request_id: str
    policy: str
    prompt_tokens: int
    block_size: int
    predicted_reused_tokens: int
    reason: str
    chosen: dict | None
    alternatives: list[dict]
    # Of the predicted reuse, the part the engine had reported stored when the plan was
    # made; the rest was claimed for requests still prefilling there (pending_blocks).
    predicted_stored_tokens: int = 0
    # Of the predicted reuse, the part to load from the prefilling worker's node KV store.
    predicted_tier_tokens: int = 0
    # Seconds the plan's prefill was estimated to stall the decodes running on its worker,
    # summed over them (``Estimate.stall``); ``actual.stall_seconds`` is what was measured.
    predicted_stall_seconds: float = 0.0
    tenant: str = "anonymous"
    created_at: float = field(default_factory=time.time)
    actual: Actual = field(default_factory=Actual)

    @classmethod
    def from_decision(cls, decision: Decision, response_id: str, choice_index: int, request_id: str,
                      prompt_tokens: int, block_size: int, stored_tokens: int, tenant: str = "anonymous"
                      ) -> DecisionRecord:
        """``stored_tokens``: the leading prompt tokens the prefilling worker had reported stored."""
        chosen = decision.chosen
        estimate = chosen.estimate if chosen else None
        predicted = estimate.reused_tokens if estimate else 0
        tier = estimate.tier_tokens if estimate else 0
        return cls(response_id, choice_index, request_id, decision.policy, prompt_tokens, block_size, predicted,
                   decision.reason, plan_summary(chosen) if chosen else None,
                   [plan_summary(p) for p in decision.alternatives if p is not chosen],
                   predicted_stored_tokens=min(stored_tokens, predicted - tier), predicted_tier_tokens=tier,
                   predicted_stall_seconds=estimate.stall if estimate else 0.0, tenant=tenant)

    def index_overestimated(self) -> bool:
        """The engine lacked blocks it had reported stored: the index is stale."""
        return self._reused_below(self.predicted_stored_tokens)

    def claim_overestimated(self) -> bool:
        """The engine lacked claimed blocks only: the request that claimed them had not
        stored them in time (same step, still queued, evicted, or moved), not a stale index."""
        return (self._reused_below(self.predicted_reused_tokens - self.predicted_tier_tokens)
                and not self.index_overestimated())

    def tier_overestimated(self) -> bool:
        """The engine had the blocks it was credited with, but the node store gave fewer than
        predicted: the store evicted them or was out of reach since the orchestrator last
        read its events."""
        return (self.predicted_tier_tokens > 0 and self._reused_below(self.predicted_reused_tokens)
                and not self.claim_overestimated() and not self.index_overestimated())

    def _reused_below(self, predicted: int) -> bool:
        reused = self.actual.reused_tokens
        return reused is not None and reused + self.block_size <= predicted

    def to_dict(self) -> dict:
        return asdict(self)


class DecisionLog:
    """Bounded, most recent last. Single writer: the event loop.

    One record per placement: a request moved after a worker failed keeps the record of
    each worker it ran on (the continuation's request id ends in ``-m<n>``), in order."""

    def __init__(self, capacity: int = 2000):
        self.capacity = capacity
        self._records: OrderedDict[tuple[str, int, str], DecisionRecord] = OrderedDict()

    def add(self, record: DecisionRecord) -> None:
        self._records[(record.response_id, record.choice_index, record.request_id)] = record
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)

    def finish(self, record: DecisionRecord) -> None:
        if logger.isEnabledFor(logging.INFO):  # encoding a record costs more than the rest of its bookkeeping
            logger.info("%s", _record_encoder.encode(record).decode())

    def by_response(self, response_id: str, tenant: str | None = None) -> list[DecisionRecord]:
        """``tenant``: only that tenant's records (None: every tenant's)."""
        return [r for (rid, _, _), r in self._records.items()
                if rid == response_id and (tenant is None or r.tenant == tenant)]

    def recent(self, limit: int, tenant: str | None = None) -> list[DecisionRecord]:
        """The ``limit`` newest records, newest first; ``tenant`` as in ``by_response``."""
        newest_first = reversed(self._records.values())
        return list(itertools.islice((r for r in newest_first if tenant is None or r.tenant == tenant), limit))
