"""Estimate vs actual, fed back: stale index entries get resynced, timings calibrate the model.

A predicted hit on blocks the engine had reported stored that did not happen means the
index was stale for that worker, so the worker's entries are reloaded from its snapshot.
A miss on blocks only claimed for a request still prefilling there is counted, not
resynced: the index was right, the earlier request had not stored them in time. Prefill timings are taken only from
requests that found their workers idle, and no busy engine on their CPU cores, where TTFT is (almost) pure
prefill time at the worker's own speed; the planner adds what sharing a core costs.
Link estimates come from the pulls the decode workers' connectors timed, and the node
store's per-tier load estimates from the loads the prefilling workers' connectors timed
(which also leaves those seconds out of the prefill's). The stall of running decodes per
second of prefill comes from the stalls measured on the streams relayed
(``orchestrator.decode_streams``), against the plan's estimated prefill.
"""

from __future__ import annotations

import logging
import time

from orchestrator.decisions import DecisionRecord
from orchestrator.index_sync import IndexSync
from orchestrator.metrics import Metrics
from orchestrator.planner.calibration import Calibration
from orchestrator.planner.views import Plan, PlanKind

logger = logging.getLogger("kvroute.orchestrator.feedback")


class Feedback:
    def __init__(self, index_sync: IndexSync, calibration: Calibration, metrics: Metrics):
        self.index_sync = index_sync
        self.calibration = calibration
        self.metrics = metrics

    def observe(self, plan: Plan, record: DecisionRecord, idle_at_start: bool,
                prefilling_role: str | None = None, block_bytes: int = 0) -> None:
        """``prefilling_role``: the role of the worker that prefilled, whose timings calibrate
        that class of worker (None: the worker left; its pool's role by the plan's kind);
        ``block_bytes``: the bytes of one of its KV blocks (0: unknown)."""
        prefilling = plan.prefilling_worker
        indexed = plan.source_worker or prefilling  # where the index said the reused blocks were
        if record.index_overestimated():
            self.metrics.observe_misprediction(indexed)
            logger.warning("index had %d tokens stored on %s, engine reused %d; resyncing",
                           record.predicted_stored_tokens, indexed, record.actual.reused_tokens)
            self.index_sync.request_resync(indexed)
        elif record.claim_overestimated():
            self.metrics.observe_claim_miss(prefilling)
            logger.info("request %s expected %d tokens on %s (%d claimed), engine reused %d",
                        record.request_id, record.predicted_reused_tokens, prefilling,
                        record.predicted_reused_tokens - record.predicted_stored_tokens, record.actual.reused_tokens)
        elif record.tier_overestimated():
            self.metrics.observe_tier_miss(prefilling)
            logger.info("request %s expected %d tokens from %s's node store, it loaded %d", record.request_id,
                        record.predicted_tier_tokens, prefilling, record.actual.tier_tokens or 0)
        actual, now = record.actual, time.monotonic()
        tier_seconds = actual.tier_seconds or 0.0
        if actual.tier_tokens and tier_seconds > 0 and block_bytes:
            estimate = plan.estimate
            tier = "disk" if estimate is not None and 2 * estimate.tier_disk_tokens > estimate.tier_tokens else "host"
            num_bytes = actual.tier_tokens // record.block_size * block_bytes
            self.calibration.observe_tier_load(tier, num_bytes, tier_seconds, now=now)
            self.metrics.observe_tier_load(prefilling, tier, num_bytes, tier_seconds)
        if actual.stall_seconds is not None and plan.estimate is not None:
            self.calibration.observe_stall(actual.stall_seconds, actual.stalled_streams or 0, plan.estimate.prefill,
                                           now=now)
        lender = plan.lending_worker
        if lender and actual.transfer_bytes:
            self.calibration.observe_link(lender, plan.decode_worker, actual.transfer_bytes, actual.transfer_seconds,
                                           now=now)
            self.metrics.observe_transfer(lender, plan.decode_worker, actual.transfer_bytes, actual.transfer_seconds)
        shared_cores = plan.estimate is not None and plan.estimate.contention > 0
        # A PULL's first token also waited for the lend and the transfer: not a prefill speed.
        measures_prefill = plan.kind is not PlanKind.PULL and not shared_cores
        if idle_at_start and measures_prefill and actual.ttft is not None and actual.reused_tokens is not None:
            role = prefilling_role or ("prefill" if plan.kind is PlanKind.DISAGG else "decode")
            new_tokens = record.prompt_tokens - actual.reused_tokens
            self.calibration.observe_prefill(role, new_tokens, actual.reused_tokens, actual.ttft - tier_seconds,
                                             worker_id=prefilling, now=now)
