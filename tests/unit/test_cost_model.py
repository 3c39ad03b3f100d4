"""Table tests for the cost model and its online calibration."""

from dataclasses import astuple, replace

import numpy as np
import pytest

from orchestrator.planner import cost_model as cost
from orchestrator.planner.calibration import (
    MEASUREMENT_MEMORY_SECONDS,
    Calibration,
    LinkCalibrator,
    PrefillCalibrator,
    calibrated_model,
)
from orchestrator.planner.cost_model import CostModel, LinkEstimate, PrefillCoefficients
from orchestrator.planner.views import WorkerView

MODEL = CostModel()


def worker(worker_id="w0", role="prefill", **fields) -> WorkerView:
    defaults = dict(num_running=0, num_waiting=0, num_queued_prefill_tokens=0, num_free_blocks=1000,
                    num_total_blocks=1000, block_size=16, bytes_per_block=16 * 23_040)
    return WorkerView(worker_id, role, **{**defaults, **fields})


def test_defaults_match_the_measured_prefills():
    assert cost.prefill_seconds(MODEL, 900, 0) == pytest.approx(0.38, rel=0.05)
    assert cost.prefill_seconds(MODEL, 4, 896) == pytest.approx(0.054, rel=0.1)


@pytest.mark.parametrize("fewer, more", [(1, 2), (16, 17), (100, 900), (900, 4000)])
@pytest.mark.parametrize("cached", [0, 512, 4096])
def test_more_new_tokens_take_longer(fewer, more, cached):
    assert cost.prefill_seconds(MODEL, more, cached) > cost.prefill_seconds(MODEL, fewer, cached)


@pytest.mark.parametrize("less, more", [(0, 16), (16, 512), (512, 4096)])
def test_more_cached_context_costs_attention_but_a_cached_prefix_saves_work(less, more):
    # The same new tokens attend over a longer cached context: a little slower...
    assert cost.prefill_seconds(MODEL, 100, more) > cost.prefill_seconds(MODEL, 100, less)
    # ...but for a fixed prompt, each cached token is one fewer to compute: much faster.
    prompt = 5000
    assert cost.prefill_seconds(MODEL, prompt - more, more) < cost.prefill_seconds(MODEL, prompt - less, less)


def test_nothing_new_costs_nothing():
    assert cost.prefill_seconds(MODEL, 0, 900) == 0.0


@pytest.mark.parametrize("num_bytes, link, expected", [
    (0, LinkEstimate(1e9, 0.001), 0.0),
    (1_000_000_000, LinkEstimate(1e9, 0.001), 1.001),
    (3_000_000, LinkEstimate(3e9, 0.002), 0.003),
    (23_040 * 900, cost.DEFAULT_LINK, 0.001 + 23_040 * 900 / 3e9),
])
def test_transfer_is_latency_plus_bytes_over_bandwidth(num_bytes, link, expected):
    assert cost.transfer_seconds(num_bytes, link) == pytest.approx(expected)


def test_links_fall_back_to_the_default():
    fast = LinkEstimate(10e9, 0.0001)
    model = CostModel(links={("p0", "d0"): fast})
    assert model.link("p0", "d0") == fast
    assert model.link("d0", "p0") == cost.DEFAULT_LINK


def test_queue_wait_grows_with_queued_tokens_and_active_requests():
    idle = worker()
    assert cost.queue_wait_seconds(MODEL, idle) == 0.0
    queued = worker(num_waiting=1, num_queued_prefill_tokens=900)
    assert cost.queue_wait_seconds(MODEL, queued) == pytest.approx(0.05 + 900 * 3.1e-4 + 0.005)
    # in-flight requests the worker has not reported yet still count
    assert cost.queue_wait_seconds(MODEL, worker(in_flight=4)) == pytest.approx(4 * 0.005)


def queued_alone(tokens: int) -> float:
    coefficients = MODEL.prefill
    return (coefficients.fixed_seconds + tokens * coefficients.per_token_seconds
            + coefficients.attention_seconds * tokens * tokens / 2)


def sharing(*tokens: int) -> WorkerView:
    return worker(num_waiting=len(tokens), num_queued_prefill_tokens=sum(tokens), queued_prompts=tokens,
                  prompt_step_cap=256)


def test_the_oldest_queued_prompt_is_waited_for_and_the_others_share_steps():
    """Prompts of 1,000, 3,000 and 300 tokens queued (0.36, 0.98 and 0.143 s alone): a
    0.5 s prefill waits for the oldest in full (a prompt alone takes whole steps), then
    shares 0.5 s with the long one and 0.143 s with the short one, and delays them as much."""
    queued = sharing(1000, 3000, 300)
    shared = 0.5 + queued_alone(300)
    assert cost.queue_wait_seconds(MODEL, queued, 0.5) == pytest.approx(queued_alone(1000) + shared + 3 * 0.005)
    assert cost.queue_delay_seconds(MODEL, queued, 0.5) == pytest.approx(shared)
    # a prefill longer than every queued prompt waits for all of them, as in turn
    in_turn = queued_alone(1000) + queued_alone(3000) + queued_alone(300)
    assert cost.queue_wait_seconds(MODEL, queued, 5.0) == pytest.approx(in_turn + 3 * 0.005)
    assert cost.queue_delay_seconds(MODEL, queued, 5.0) == pytest.approx(in_turn - queued_alone(1000))


def test_a_prompt_computing_alone_is_waited_for_in_full_and_not_delayed():
    alone = sharing(3000)
    assert cost.queue_wait_seconds(MODEL, alone, 0.1) == pytest.approx(queued_alone(3000) + 0.005)
    assert cost.queue_delay_seconds(MODEL, alone, 0.1) == 0.0


def test_the_part_of_the_oldest_prompt_already_computed_is_not_waited_for():
    """A 3,000-token prompt alone (0.98 s) that has computed 0.6 s inside its one engine
    step leaves 0.38 s; one past its estimate is priced at a tenth of it, not as done."""
    started = replace(sharing(3000), head_prompt_elapsed=0.6)
    assert cost.queue_wait_seconds(MODEL, started, 0.1) == pytest.approx(queued_alone(3000) - 0.6 + 0.005)
    late = replace(sharing(3000), head_prompt_elapsed=5.0)
    assert cost.queue_wait_seconds(MODEL, late, 0.1) == pytest.approx(0.1 * queued_alone(3000) + 0.005)
    behind = replace(sharing(3000, 300), head_prompt_elapsed=0.6)  # only the oldest has started
    assert cost.queued_prompts_seconds(MODEL, behind) == pytest.approx([queued_alone(3000) - 0.6, queued_alone(300)])


def test_a_worker_serving_in_turn_makes_a_new_prefill_wait_for_everything_and_delays_nothing():
    in_turn = worker(num_waiting=2, num_queued_prefill_tokens=3300, queued_prompts=(3000, 300), prompt_step_cap=0)
    assert cost.queue_wait_seconds(MODEL, in_turn, 0.5) == pytest.approx(
        queued_alone(3000) + queued_alone(300) + 2 * 0.005)
    assert cost.queue_delay_seconds(MODEL, in_turn, 0.5) == 0.0


def test_a_worker_reporting_only_its_total_is_priced_by_the_linear_term_in_turn():
    total_only = worker(num_waiting=2, num_queued_prefill_tokens=3300, prompt_step_cap=256)
    assert cost.queue_wait_seconds(MODEL, total_only, 0.5) == pytest.approx(
        2 * 0.05 + 3300 * MODEL.prefill.per_token_seconds + 2 * 0.005)
    assert cost.queue_delay_seconds(MODEL, total_only, 0.5) == 0.0


def test_listed_prompts_are_priced_with_their_attention():
    """A long prompt's attention term is a large part of it once fitted to real prefills."""
    heavy = replace(MODEL, prefill=PrefillCoefficients(0.05, 1e-3, 7e-6))
    listed = worker(num_waiting=1, num_queued_prefill_tokens=1200, queued_prompts=(1200,))
    assert cost.queued_prefill_seconds(heavy, listed) == pytest.approx(0.05 + 1.2 + 7e-6 * 1200 * 600)
    assert cost.queued_prompt_seconds(heavy, listed) == pytest.approx(1.2 + 7e-6 * 1200 * 600)


def test_the_shared_queue_runs_at_the_workers_measured_speed():
    slow = replace(MODEL, prefill_speed={"w0": 2.0})
    assert cost.queue_delay_seconds(slow, sharing(100, 3000), 10.0) == pytest.approx(2 * queued_alone(3000))


def test_local_prefill_on_a_busy_decode_worker_is_penalised():
    assert cost.local_interference(MODEL, worker(role="decode"), 0.4, 256) == cost.NO_INTERFERENCE
    busy = cost.local_interference(MODEL, worker(role="decode", num_running=4), 0.4, 256)
    assert busy.stall == pytest.approx(4 * 0.4)  # each of the four running decodes waits for the prefill
    assert busy.charge == pytest.approx(0.4)  # a quarter of it is charged


def test_a_prefill_stalls_nothing_on_a_worker_that_does_not_decode():
    assert cost.decode_stall_seconds(MODEL, worker(role="prefill", num_running=4), 0.4) == 0.0
    assert cost.decode_stall_seconds(MODEL, worker(role="unified", num_running=4), 0.4) == pytest.approx(1.6)
    assert cost.decode_stall_seconds(replace(MODEL, stall_per_prefill_second=0.5), worker(role="unified", in_flight=4),
                                     0.4) == pytest.approx(0.8)


def test_admission_waits_behind_waiting_requests():
    assert cost.admission_seconds(MODEL, worker(role="decode")) == pytest.approx(0.020)
    assert cost.admission_seconds(MODEL, worker(role="decode", num_waiting=2)) == pytest.approx(0.060)


def test_admission_waits_for_the_decode_workers_own_prefills_still_running_on_arrival():
    """A decode worker prefilling 2,000 tokens of its own (0.62 s at the defaults) steps
    again only when that is done: blocks arriving after 0.2 s wait the other 0.42 s."""
    prefilling = worker(role="decode", num_queued_prefill_tokens=2000)
    own_prefill = 2000 * MODEL.prefill.per_token_seconds
    assert cost.admission_seconds(MODEL, prefilling, arrives_after=0.2) == pytest.approx(
        0.020 + own_prefill - 0.2)
    assert cost.admission_seconds(MODEL, prefilling, arrives_after=own_prefill + 1) == pytest.approx(0.020)


def test_the_model_is_frozen_mappings_included():
    model = CostModel(links={("p0", "d0"): cost.DEFAULT_LINK})
    with pytest.raises(TypeError):
        model.links[("p1", "d0")] = cost.DEFAULT_LINK
    source = {("p0", "d0"): cost.DEFAULT_LINK}
    model = CostModel(links=source)
    source[("p9", "d9")] = cost.DEFAULT_LINK
    assert ("p9", "d9") not in model.links


TRUE_PREFILL = PrefillCoefficients(fixed_seconds=0.03, per_token_seconds=2.0e-4, attention_seconds=1.5e-7)


def noisy_prefills(count: int, seed: int = 7, noise: float = 0.03):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        new, cached = int(rng.integers(1, 4000)), int(rng.integers(0, 4000))
        seconds = cost.prefill_seconds_with(TRUE_PREFILL, new, cached) * (1 + rng.normal(0, noise))
        yield new, cached, seconds


def test_calibration_recovers_known_coefficients_from_noisy_data():
    calibrator = PrefillCalibrator(window=256)
    for new, cached, seconds in noisy_prefills(400):
        calibrator.observe("prefill", new, cached, seconds)
    fit = calibrator.coefficients("prefill")
    for name in ("fixed_seconds", "per_token_seconds", "attention_seconds"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE_PREFILL, name), rel=0.10), name


def scaled(coefficients: PrefillCoefficients, scale: float) -> PrefillCoefficients:
    return PrefillCoefficients(*(scale * value for value in astuple(coefficients)))


def test_too_few_points_scale_the_defaults_by_the_median_ratio():
    calibrator = PrefillCalibrator(min_points=8)
    points = list(noisy_prefills(7))
    for new, cached, seconds in points:
        calibrator.observe("prefill", new, cached, seconds)
    ratio = float(np.median([seconds / cost.prefill_seconds_with(cost.DEFAULT_PREFILL, new, cached)
                             for new, cached, seconds in points]))
    assert ratio != pytest.approx(1.0, abs=0.05)  # the defaults are off for this "machine"
    fit = calibrator.coefficients("prefill")
    for name in ("fixed_seconds", "per_token_seconds", "attention_seconds"):
        assert getattr(fit, name) == pytest.approx(ratio * getattr(cost.DEFAULT_PREFILL, name))
    assert calibrator.coefficients("decode") == cost.DEFAULT_PREFILL  # nothing seen there
    assert calibrator.fitted() == {}  # no least-squares fit yet


def test_one_prefill_fixes_the_order_of_magnitude():
    """Start-up defaults ~10x too fast (as on a CPU float32 engine): one observation corrects them."""
    calibrator = PrefillCalibrator()
    calibrator.observe("decode", 766, 0, 4.0)
    assert cost.prefill_seconds_with(calibrator.coefficients("decode"), 766, 0) == pytest.approx(4.0)
    assert cost.prefill_seconds_with(calibrator.pooled(), 766, 0) == pytest.approx(4.0)


def test_points_that_cannot_determine_a_fit_still_scale_the_defaults():
    calibrator = PrefillCalibrator()
    for _ in range(20):  # one prompt shape over and over: three coefficients, one equation
        calibrator.observe("prefill", 900, 0, 0.38)
    assert calibrator.fitted() == {}
    assert cost.prefill_seconds_with(calibrator.coefficients("prefill"), 900, 0) == pytest.approx(0.38)


def test_calibration_never_returns_negative_coefficients():
    calibrator = PrefillCalibrator()
    for new in range(100, 2100, 100):  # pure per-token cost, so the fixed part wants to go below zero
        calibrator.observe("prefill", new, 0, 1e-4 * new - 0.01)
    fit = calibrator.coefficients("prefill")
    assert min(fit.fixed_seconds, fit.per_token_seconds, fit.attention_seconds) >= 0
    assert fit.per_token_seconds > 0


def test_calibration_window_follows_drift():
    calibrator = PrefillCalibrator(window=32)
    for new, cached, seconds in noisy_prefills(64, noise=0.0):
        calibrator.observe("prefill", new, cached, 2 * seconds)  # the old, slower machine
    for new, cached, seconds in noisy_prefills(32, seed=8, noise=0.0):
        calibrator.observe("prefill", new, cached, seconds)
    assert calibrator.coefficients("prefill").per_token_seconds == pytest.approx(TRUE_PREFILL.per_token_seconds)


def test_link_estimates_converge_to_the_true_link():
    true_bandwidth, true_latency = 2.5e9, 0.005  # latency well away from the 1 ms prior
    rng = np.random.default_rng(3)
    calibrator = LinkCalibrator()
    for _ in range(200):
        num_bytes = int(rng.integers(100_000, 50_000_000))
        seconds = (true_latency + num_bytes / true_bandwidth) * (1 + rng.normal(0, 0.01))
        calibrator.observe("p0", "d0", num_bytes, seconds)
    estimate = calibrator.estimate("p0", "d0")
    assert estimate.bandwidth_bytes_per_second == pytest.approx(true_bandwidth, rel=0.10)
    assert estimate.latency_seconds == pytest.approx(true_latency, rel=0.2)
    assert calibrator.estimate("p1", "d0") == cost.DEFAULT_LINK


def test_link_estimates_follow_a_change_in_bandwidth():
    calibrator = LinkCalibrator()
    sizes = [1_000_000, 20_000_000, 5_000_000, 40_000_000]
    for round_ in range(40):
        bandwidth = 3e9 if round_ < 20 else 0.5e9  # the link got congested halfway
        for size in sizes:
            calibrator.observe("p0", "d0", size, 0.001 + size / bandwidth)
    assert calibrator.estimate("p0", "d0").bandwidth_bytes_per_second == pytest.approx(0.5e9, rel=0.05)


def test_a_link_that_became_much_slower_is_relearned_from_its_latest_transfers():
    """Fast transfers, then the link drops to 6 MB/s: two surprising transfers restart it."""
    calibrator = LinkCalibrator()
    for size, seconds in [(17_694_720, 0.335), (35_389_440, 0.036), (35_389_440, 0.184)]:
        calibrator.observe("p0", "d0", size, seconds)
    slow = 6.25e6
    calibrator.observe("p0", "d0", 17_694_720, 17_694_720 / slow)
    first = calibrator.estimate("p0", "d0").bandwidth_bytes_per_second
    assert first > 2 * slow  # one surprise only moves the averages
    calibrator.observe("p0", "d0", 17_694_720, 17_694_720 / slow)
    calibrator.observe("p0", "d0", 5_898_240, 5_898_240 / slow)
    assert calibrator.estimate("p0", "d0").bandwidth_bytes_per_second == pytest.approx(slow, rel=0.05)


def test_one_hiccup_does_not_restart_a_link():
    calibrator = LinkCalibrator()
    for _ in range(10):
        calibrator.observe("p0", "d0", 10_000_000, 0.001 + 10_000_000 / 1e9)
    calibrator.observe("p0", "d0", 10_000_000, 1.0)  # 100x slower, once
    for _ in range(3):
        calibrator.observe("p0", "d0", 10_000_000, 0.001 + 10_000_000 / 1e9)
    # the averages still carry the hiccup a little, but the link was not relearned from it
    assert calibrator.estimate("p0", "d0").bandwidth_bytes_per_second > 0.1e9


def test_small_differences_are_never_surprising():
    """A transfer of 5 ms where 1 ms was estimated is 5x off but changes no plan."""
    calibrator = LinkCalibrator()
    for _ in range(10):
        calibrator.observe("p0", "d0", 1_000_000, 0.002)
    before = calibrator.estimate("p0", "d0")
    for _ in range(3):
        calibrator.observe("p0", "d0", 1_000_000, 0.010)
    after = calibrator.estimate("p0", "d0")
    assert after.bandwidth_bytes_per_second < before.bandwidth_bytes_per_second  # averaged in...
    assert after.bandwidth_bytes_per_second > 1_000_000 / 0.010  # ...not restarted from the last one


def test_a_fast_surprise_then_a_slow_one_is_no_row():
    """Measured: 4.4 MB in 5 ms, then 2.9 MB in 379 ms, on a link moving ~60 MB pulls in
    0.05-0.25 s. Restarting from the last priced a 50 MB pull at 6.4 s."""
    calibrator = LinkCalibrator()
    for size in [59_000_000, 4_400_000, 64_900_000, 2_900_000] * 5:
        calibrator.observe("p0", "d0", size, 0.04 + size / 600e6)
    calibrator.observe("p0", "d0", 4_400_000, 0.005)
    calibrator.observe("p0", "d0", 2_900_000, 0.379)
    assert cost.transfer_seconds(50_000_000, calibrator.estimate("p0", "d0")) < 0.5


def test_small_transfers_never_restart_a_link():
    calibrator = LinkCalibrator()
    for size in [59_000_000, 64_900_000] * 5:
        calibrator.observe("p0", "d0", size, 0.04 + size / 600e6)
    for _ in range(2):
        calibrator.observe("p0", "d0", 2_900_000, 0.4)  # over 3x slower, twice, but small
    assert cost.transfer_seconds(50_000_000, calibrator.estimate("p0", "d0")) < 0.5
    for _ in range(2):
        calibrator.observe("p0", "d0", 60_000_000, 6.0)  # large and slow, twice: changed
    assert cost.transfer_seconds(60_000_000, calibrator.estimate("p0", "d0")) == pytest.approx(6.0, rel=0.05)


def test_same_size_transfers_keep_the_prior_latency_and_solve_for_bandwidth():
    calibrator = LinkCalibrator()
    for _ in range(10):
        calibrator.observe("p0", "d0", 10_000_000, 0.001 + 10_000_000 / 1e9)
    estimate = calibrator.estimate("p0", "d0")
    assert estimate.latency_seconds == pytest.approx(0.001)
    assert estimate.bandwidth_bytes_per_second == pytest.approx(1e9)


def test_calibrated_model_carries_fits_and_links_and_leaves_the_base_alone():
    calibration = Calibration(CostModel(decode_step_seconds=0.03))
    for new, cached, seconds in noisy_prefills(50, noise=0.0):
        calibration.observe_prefill("prefill", new, cached, seconds)
    calibration.observe_link("p0", "d0", 10_000_000, 0.011)
    model = calibration.calibrated_model()
    assert model.coefficients_for("prefill").per_token_seconds == pytest.approx(TRUE_PREFILL.per_token_seconds)
    # No decode prefill was seen: the decode class borrows the pooled fit, not the defaults.
    assert model.coefficients_for("decode").per_token_seconds == pytest.approx(TRUE_PREFILL.per_token_seconds)
    assert model.link("p0", "d0").bandwidth_bytes_per_second == pytest.approx(1e9)
    assert model.decode_step_seconds == 0.03
    assert calibration.base.prefill_by_class == {} and calibration.base.links == {}
    assert calibrated_model(replace(model), calibration.prefill, calibration.links) == model


def test_a_class_without_enough_points_borrows_the_pooled_fit():
    """Start-up defaults can be an order of magnitude off; the other pool's fit is not."""
    calibrator = PrefillCalibrator(min_points=8)
    points = list(noisy_prefills(40, noise=0.0))
    for new, cached, seconds in points[:37]:
        calibrator.observe("prefill", new, cached, seconds)
    for new, cached, seconds in points[37:]:  # 3 points: too few for a fit of its own
        calibrator.observe("decode", new, cached, seconds)
    assert set(calibrator.fitted()) == {"prefill"}
    pooled = calibrator.pooled()
    assert pooled.per_token_seconds == pytest.approx(TRUE_PREFILL.per_token_seconds)
    model = calibrated_model(CostModel(), calibrator, LinkCalibrator())
    assert model.coefficients_for("decode") == pooled
    assert model.coefficients_for("prefill") == calibrator.fitted()["prefill"]


def test_before_enough_points_anywhere_the_pool_borrows_the_scaled_defaults():
    calibrator = PrefillCalibrator(min_points=8)
    assert calibrator.pooled() is None
    model = calibrated_model(CostModel(), calibrator, LinkCalibrator())
    assert model.coefficients_for("decode") == cost.DEFAULT_PREFILL
    points = list(noisy_prefills(7))
    for new, cached, seconds in points[:6]:
        calibrator.observe("decode", new, cached, seconds)
    calibrator.observe("prefill", *points[6])
    model = calibrated_model(CostModel(), calibrator, LinkCalibrator())
    assert calibrator.fitted() == {}
    assert model.coefficients_for("decode") == model.coefficients_for("prefill") == calibrator.pooled()
    assert calibrator.pooled() != cost.DEFAULT_PREFILL


def test_each_worker_gets_its_speed_against_its_class():
    """Two prefill workers share one fit; the one sharing its core with a busy neighbour
    runs 1.5x slower than the other, and the model prices each as it runs."""
    calibration = Calibration()
    for new, cached, seconds in noisy_prefills(40, noise=0.01):
        calibration.observe_prefill("prefill", new, cached, seconds, worker_id="fast")
        calibration.observe_prefill("prefill", new, cached, 1.5 * seconds, worker_id="slow")
    model = calibration.calibrated_model()
    assert model.prefill_speed["slow"] / model.prefill_speed["fast"] == pytest.approx(1.5, rel=0.03)
    class_estimate = cost.prefill_seconds(model, 1000, 0, "prefill")
    assert cost.prefill_seconds(model, 1000, 0, "prefill", "slow") == pytest.approx(
        model.prefill_speed["slow"] * class_estimate)
    assert cost.prefill_seconds(model, 1000, 0, "prefill", "unseen") == class_estimate


def test_a_worker_speed_needs_a_few_prefills_and_follows_recent_ones():
    calibration = Calibration()
    points = list(noisy_prefills(60, noise=0.0))
    for new, cached, seconds in points[:20]:
        calibration.observe_prefill("prefill", new, cached, seconds, worker_id="steady")
    for new, cached, seconds in points[20:23]:
        calibration.observe_prefill("prefill", new, cached, 2 * seconds, worker_id="new")
    assert "new" not in calibration.calibrated_model().prefill_speed  # three prefills say too little
    calibration.observe_prefill("prefill", *points[23][:2], 2 * points[23][2], worker_id="new")
    assert calibration.calibrated_model().prefill_speed["new"] > 1.2
    for new, cached, seconds in points[24:60]:  # its neighbour went idle: it runs like the rest
        calibration.observe_prefill("prefill", new, cached, seconds, worker_id="new")
    assert calibration.calibrated_model().prefill_speed["new"] == pytest.approx(
        calibration.calibrated_model().prefill_speed["steady"], rel=0.1)


def test_prefills_without_a_worker_count_for_the_class_only():
    calibration = Calibration()
    for new, cached, seconds in noisy_prefills(20):
        calibration.observe_prefill("prefill", new, cached, seconds)
    model = calibration.calibrated_model()
    assert model.prefill_speed == {} and "prefill" in model.prefill_by_class


def test_a_slower_worker_is_priced_slower_for_its_queue_too():
    queued = worker(num_waiting=2, num_queued_prefill_tokens=2000)
    slow = CostModel(prefill_speed={queued.worker_id: 2.0})
    interleave = MODEL.interleave_seconds_per_active * 2  # the batch's share, whatever the speed
    assert cost.queue_wait_seconds(slow, queued) - interleave == pytest.approx(
        2 * (cost.queue_wait_seconds(MODEL, queued) - interleave))


MEMORY = MEASUREMENT_MEMORY_SECONDS


def test_a_link_not_used_for_the_memory_is_priced_like_the_fleets_typical_link():
    """A link priced at 7 MB/s (others run at 500 MB/s) is not chosen, so never
    corrected. Past the memory it is priced like the links in use, and its next
    transfer relearns it from scratch."""
    calibration = Calibration()
    for second in range(0, 200, 10):
        calibration.observe_link("p0", "d0", 60_000_000, 0.001 + 60_000_000 / 500e6, now=second)
    calibration.observe_link("p1", "d0", 59_000_000, 0.001 + 59_000_000 / 500e6, now=90.0)
    for num_bytes, seconds in [(63_000_000, 0.45), (60_000_000, 8.5)]:  # two slow surprises: restarted slow
        calibration.observe_link("p1", "d0", num_bytes, seconds, now=100.0)
    assert calibration.calibrated_model(now=101.0).link("p1", "d0").bandwidth_bytes_per_second < 10e6
    later = calibration.calibrated_model(now=100.0 + MEMORY + 1)
    assert later.link("p1", "d0").bandwidth_bytes_per_second == pytest.approx(500e6, rel=0.01)
    calibration.observe_link("p1", "d0", 60_000_000, 0.001 + 60_000_000 / 400e6, now=100.0 + MEMORY + 2)
    relearned = calibration.calibrated_model(now=100.0 + MEMORY + 3).link("p1", "d0")
    assert relearned.bandwidth_bytes_per_second == pytest.approx(400e6, rel=0.01)


def test_the_typical_link_is_the_median_of_the_links_in_use_else_the_prior():
    links = LinkCalibrator()
    assert links.typical(now=0.0) == cost.DEFAULT_LINK
    for name, bandwidth in [("p0", 100e6), ("p1", 200e6), ("p2", 900e6)]:
        links.observe(name, "d0", 10_000_000, 0.001 + 10_000_000 / bandwidth, now=0.0)
    assert links.typical(now=1.0).bandwidth_bytes_per_second == pytest.approx(200e6)
    links.observe("p2", "d0", 10_000_000, 0.001 + 10_000_000 / 900e6, now=MEMORY)
    assert links.typical(now=MEMORY + 1).bandwidth_bytes_per_second == pytest.approx(900e6)  # only p2 in use
    assert links.typical(now=3 * MEMORY) == cost.DEFAULT_LINK  # none in use
    assert set(links.estimates(now=3 * MEMORY)) == set() and len(links.estimates()) == 3


def test_a_worker_speed_is_forgotten_after_the_memory():
    """A worker measured slow in a bad minute is priced like its class again afterwards,
    so it is chosen, and measured, again."""
    calibration = Calibration()
    for index, (new, cached, seconds) in enumerate(noisy_prefills(8, noise=0.0)):
        calibration.observe_prefill("prefill", new, cached, seconds, worker_id="steady", now=float(index))
        calibration.observe_prefill("prefill", new, cached, 1.5 * seconds, worker_id="unlucky", now=float(index))
    speeds = calibration.calibrated_model(now=10.0).prefill_speed
    assert speeds["unlucky"] / speeds["steady"] == pytest.approx(1.5)
    later = calibration.calibrated_model(now=8.0 + MEMORY)
    assert "unlucky" not in later.prefill_speed and "steady" not in later.prefill_speed
    assert cost.prefill_seconds(later, 1000, 0, "prefill", "unlucky") == cost.prefill_seconds(later, 1000, 0, "prefill")


def test_without_a_clock_measurements_are_never_forgotten():
    calibration = Calibration()
    calibration.observe_link("p0", "d0", 10_000_000, 0.011)
    for new, cached, seconds in noisy_prefills(8, noise=0.0):
        calibration.observe_prefill("prefill", new, cached, seconds, worker_id="steady")
        calibration.observe_prefill("prefill", new, cached, 2 * seconds, worker_id="slow")
    model = calibration.calibrated_model(now=1e9)
    assert model.link("p0", "d0").bandwidth_bytes_per_second == pytest.approx(1e9)
    assert model.prefill_speed["slow"] / model.prefill_speed["steady"] == pytest.approx(2.0)


def test_the_snapshot_is_refit_only_when_something_new_or_something_forgotten():
    """Planning asks for the model on every request; a refit there costs a least-squares fit."""
    calibration = Calibration()
    calibration.observe_link("p0", "d0", 10_000_000, 0.011, now=0.0)
    first = calibration.calibrated_model(now=1.0)
    assert calibration.calibrated_model(now=MEMORY - 1) is first
    forgotten = calibration.calibrated_model(now=MEMORY + 1)
    assert forgotten is not first and forgotten.links == {}
