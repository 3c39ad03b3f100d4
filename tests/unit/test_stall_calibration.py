"""The stall of running decodes per second of prefill, learnt from the stalls measured:
it moves toward them, stays within its bounds, and is forgotten after the memory."""

from __future__ import annotations

import time

import pytest

from orchestrator.decisions import DecisionRecord
from orchestrator.feedback import Feedback
from orchestrator.metrics import Metrics
from orchestrator.planner import cost_model as cost
from orchestrator.planner.calibration import (
    MEASUREMENT_MEMORY_SECONDS,
    STALL_RATIO_BOUNDS,
    Calibration,
    StallCalibrator,
)
from orchestrator.planner.views import Decision, Estimate, Plan, PlanKind, WorkerView

DECODING = WorkerView("d0", "decode", num_running=4, num_waiting=0, num_queued_prefill_tokens=0, num_free_blocks=100,
                      num_total_blocks=100, block_size=16, bytes_per_block=16 * 23_040)


def test_it_starts_from_the_default_and_moves_toward_what_is_measured():
    calibrator = StallCalibrator()
    assert calibrator.ratio() == cost.DEFAULT_STALL_PER_PREFILL_SECOND
    ratios = []
    for _ in range(20):  # each prefill of 0.5 s estimated stalled each of 4 streams for 1.25 s
        calibrator.observe(stall_seconds=5.0, streams=4, prefill_seconds=0.5)
        ratios.append(calibrator.ratio())
    assert ratios == sorted(ratios) and ratios[0] < 2.5
    assert ratios[-1] == pytest.approx(2.5, rel=0.02)


def test_one_odd_measurement_moves_it_by_a_bounded_step_and_it_never_leaves_its_bounds():
    calibrator = StallCalibrator()
    calibrator.observe(stall_seconds=1000.0, streams=1, prefill_seconds=0.1)  # a client that stopped reading
    low, high = STALL_RATIO_BOUNDS
    assert calibrator.ratio() == pytest.approx(1.0 + calibrator.smoothing * (high - 1.0))
    for _ in range(100):
        calibrator.observe(stall_seconds=1000.0, streams=1, prefill_seconds=0.1)
    assert calibrator.ratio() == pytest.approx(high)
    for _ in range(100):
        calibrator.observe(stall_seconds=0.0, streams=3, prefill_seconds=0.1)
    assert calibrator.ratio() == pytest.approx(low)


def test_measurements_without_streams_or_an_estimate_say_nothing():
    calibrator = StallCalibrator()
    calibrator.observe(stall_seconds=1.0, streams=0, prefill_seconds=0.5)
    calibrator.observe(stall_seconds=1.0, streams=2, prefill_seconds=0.0)
    assert calibrator.ratio() == cost.DEFAULT_STALL_PER_PREFILL_SECOND


def test_the_planners_stall_estimate_follows_the_calibration_and_forgets_it_after_the_memory():
    calibration, now = Calibration(refit_interval=0.0), 100.0
    before = cost.decode_stall_seconds(calibration.calibrated_model(now), DECODING, 0.5)
    for _ in range(30):
        calibration.observe_stall(stall_seconds=8.0, streams=4, prefill_seconds=0.5, now=now)  # 4x the prefill
    model = calibration.calibrated_model(now)
    assert before == pytest.approx(4 * 0.5)
    assert cost.decode_stall_seconds(model, DECODING, 0.5) == pytest.approx(4 * 0.5 * 4.0, rel=0.01)
    forgotten = calibration.calibrated_model(now + MEASUREMENT_MEMORY_SECONDS + 1)
    assert forgotten.stall_per_prefill_second == cost.DEFAULT_STALL_PER_PREFILL_SECOND


def test_a_measured_stall_is_fed_back_against_the_plans_estimated_prefill():
    calibration = Calibration(refit_interval=0.0)
    loop = Feedback(index_sync=None, calibration=calibration, metrics=Metrics())
    estimate = Estimate(queue_wait=0.0, prefill=0.4, transfer=0.0, ttft=0.4, gap=0.0, reused_tokens=0,
                        transfer_bytes=0, interference=0.4, stall=1.6)
    plan = Plan(PlanKind.LOCAL, "d0", None, estimate)
    record = DecisionRecord.from_decision(Decision("cache_aware", plan, (plan,), "test"), "r", 0, "req", 300, 16, 0)
    record.actual.stall_seconds, record.actual.stalled_streams = 3.2, 4  # 0.8 s each: twice the prefill
    loop.observe(plan, record, idle_at_start=False)
    ratio = calibration.calibrated_model(time.monotonic()).stall_per_prefill_second
    assert ratio == pytest.approx(1.0 + calibration.stalls.smoothing * (2.0 - 1.0))
