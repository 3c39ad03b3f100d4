"""Estimate vs actual, fed back: which misses reload a worker's index, which only count."""

from __future__ import annotations

import dataclasses
import time

from orchestrator.decisions import DecisionRecord
from orchestrator.feedback import Feedback
from orchestrator.metrics import Metrics
from orchestrator.planner.calibration import MEASUREMENT_MEMORY_SECONDS, Calibration
from orchestrator.planner.views import Decision, Estimate, Plan, PlanKind

BLOCK = 128


class RecordingSync:
    def __init__(self):
        self.resynced: list[str] = []

    def request_resync(self, worker_id: str) -> None:
        self.resynced.append(worker_id)


def feedback() -> tuple[Feedback, RecordingSync, Metrics]:
    sync, metrics = RecordingSync(), Metrics()
    return Feedback(sync, Calibration(), metrics), sync, metrics


def disagg() -> Plan:
    return Plan(kind=PlanKind.DISAGG, prefill_worker="prefill-a", decode_worker="decode-a")


def record(predicted: int, stored: int, reused: int) -> DecisionRecord:
    result = DecisionRecord(response_id="chatcmpl-1", choice_index=0, request_id="req", policy="cache_aware",
                            prompt_tokens=1300, block_size=BLOCK, predicted_reused_tokens=predicted, reason="test",
                            chosen=None, alternatives=[], predicted_stored_tokens=stored)
    result.actual.reused_tokens = reused
    return result


def count(metrics: Metrics, name: str, worker: str) -> float:
    return metrics.registry.get_sample_value(f"{name}_total", {"worker": worker}) or 0.0


def test_missing_blocks_the_engine_had_reported_stored_reload_its_index():
    loop, sync, metrics = feedback()
    loop.observe(disagg(), record(predicted=1152, stored=1152, reused=640), idle_at_start=False)
    assert sync.resynced == ["prefill-a"]
    assert count(metrics, "kvroute_index_mispredictions", "prefill-a") == 1
    assert count(metrics, "kvroute_claim_misses", "prefill-a") == 0


def test_missing_blocks_that_were_only_claimed_count_without_a_reload():
    loop, sync, metrics = feedback()
    loop.observe(disagg(), record(predicted=1152, stored=512, reused=512), idle_at_start=False)
    assert sync.resynced == []
    assert count(metrics, "kvroute_claim_misses", "prefill-a") == 1
    assert count(metrics, "kvroute_index_mispredictions", "prefill-a") == 0


def test_a_miss_within_one_block_is_no_miss():
    loop, sync, metrics = feedback()
    loop.observe(disagg(), record(predicted=1152, stored=1152, reused=1152 - BLOCK + 1), idle_at_start=False)
    loop.observe(disagg(), record(predicted=1152, stored=1152, reused=1152), idle_at_start=False)
    assert sync.resynced == []
    assert count(metrics, "kvroute_claim_misses", "prefill-a") == 0


def test_the_stored_part_of_a_prediction_never_exceeds_the_prediction():
    estimate = Estimate(queue_wait=0.0, prefill=1.0, transfer=0.01, ttft=1.0, gap=0.05, reused_tokens=1024,
                        transfer_bytes=0)
    plan = dataclasses.replace(disagg(), estimate=estimate)
    decision = Decision(policy="cache_aware", chosen=plan, alternatives=(plan,), reason="test")
    made = DecisionRecord.from_decision(decision, "chatcmpl-2", 0, "req-2", 1300, BLOCK, stored_tokens=1280)
    assert (made.predicted_reused_tokens, made.predicted_stored_tokens) == (1024, 1024)
    assert made.alternatives == []


def test_fed_back_transfers_are_stamped_with_the_clock_and_forgotten_after_the_memory():
    loop, _, _ = feedback()
    slow_pull = record(predicted=0, stored=0, reused=0)
    slow_pull.actual.transfer_bytes, slow_pull.actual.transfer_seconds = 50_000_000, 5.0  # 10 MB/s
    loop.observe(disagg(), slow_pull, idle_at_start=False)
    now = time.monotonic()
    assert loop.calibration.calibrated_model(now).link("prefill-a", "decode-a").bandwidth_bytes_per_second < 11e6
    forgotten = loop.calibration.calibrated_model(now + MEASUREMENT_MEMORY_SECONDS + 1)
    assert forgotten.link("prefill-a", "decode-a") == loop.calibration.base.default_link  # the prior


def pull() -> Plan:
    return Plan(kind=PlanKind.PULL, prefill_worker=None, decode_worker="unified-b", source_worker="unified-a",
                lend_tokens=1024)


def test_a_pull_teaches_the_link_from_its_source_and_never_the_prefill_speed():
    loop, _, _ = feedback()
    timed: list[str] = []
    loop.calibration.observe_prefill = lambda role, *args, **kwargs: timed.append(role)
    pulled = record(predicted=1024, stored=1024, reused=1024)
    pulled.actual.transfer_bytes, pulled.actual.transfer_seconds = 50_000_000, 5.0
    pulled.actual.ttft = 9.0  # lend + transfer + the rest: not how fast unified-b prefills
    loop.observe(pull(), pulled, idle_at_start=True, prefilling_role="unified")
    assert loop.calibration.calibrated_model(time.monotonic()).link(
        "unified-a", "unified-b").bandwidth_bytes_per_second < 11e6
    assert timed == []
    local = Plan(kind=PlanKind.LOCAL, prefill_worker=None, decode_worker="unified-b")
    loop.observe(local, pulled, idle_at_start=True, prefilling_role="unified")
    assert timed == ["unified"]  # the same timings from a LOCAL plan do calibrate


def test_a_pull_that_reused_less_than_its_source_had_stored_reloads_the_source_index():
    loop, sync, metrics = feedback()
    loop.observe(pull(), record(predicted=1024, stored=1024, reused=0), idle_at_start=False)
    assert sync.resynced == ["unified-a"] and count(metrics, "kvroute_index_mispredictions", "unified-a") == 1


def test_a_store_load_teaches_its_tier_and_is_left_out_of_the_prefill_speed():
    loop, sync, metrics = feedback()
    timed: list[float] = []
    loop.calibration.observe_prefill = lambda role, new, cached, seconds, **kwargs: timed.append(seconds)
    loaded = record(predicted=1024, stored=0, reused=1024)
    loaded.actual.tier_tokens, loaded.actual.tier_seconds, loaded.actual.ttft = 1024, 0.25, 0.75
    local = Plan(kind=PlanKind.LOCAL, prefill_worker=None, decode_worker="unified-b")
    loop.observe(local, loaded, idle_at_start=True, prefilling_role="unified", block_bytes=1_000_000)
    assert timed == [0.5], "the prefill took the TTFT less the load"
    host = loop.calibration.calibrated_model(time.monotonic()).tier_loads["host"]
    assert abs(host.latency_seconds + 8_000_000 / host.bandwidth_bytes_per_second - 0.25) < 1e-6, \
        "8 blocks of 1 MB in 0.25 s"
    assert metrics.registry.get_sample_value("kvroute_tier_load_bytes_total",
                                             {"worker": "unified-b", "tier": "host"}) == 8_000_000
    assert sync.resynced == [] and count(metrics, "kvroute_tier_misses", "unified-b") == 0


def test_a_store_that_gave_less_than_planned_counts_a_tier_miss_without_a_reload():
    loop, sync, metrics = feedback()
    missed = record(predicted=1024, stored=256, reused=256)
    missed.predicted_tier_tokens, missed.actual.tier_tokens = 768, 0
    loop.observe(Plan(kind=PlanKind.LOCAL, prefill_worker=None, decode_worker="unified-b"), missed,
                 idle_at_start=False)
    assert sync.resynced == [] and count(metrics, "kvroute_tier_misses", "unified-b") == 1
    assert count(metrics, "kvroute_claim_misses", "unified-b") == 0
