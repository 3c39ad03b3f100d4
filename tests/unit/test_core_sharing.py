"""Engines that share CPU cores: what workers report, which neighbours the planner sees,
what sharing a core costs, and what the planner then does."""

from __future__ import annotations

import dataclasses
import math

import pytest

from foundation import wire
from orchestrator.core_sharing import with_core_neighbours
from orchestrator.decisions import DecisionRecord
from orchestrator.feedback import Feedback
from orchestrator.metrics import Metrics
from orchestrator.planner import cost_model as cost
from orchestrator.planner.calibration import Calibration
from orchestrator.planner.cost_model import CostModel
from orchestrator.planner.planner import CacheAwarePlanner
from orchestrator.planner.views import Estimate, Plan, PlanKind, RequestView, WorkerView
from simulator.cpu import Cores, CpuSettings, core_bindings
from worker.cores import bound_cores, core_binding, machine_id

BLOCK = 16
MODEL = CostModel()
REQUEST = RequestView("r1", prompt_tokens=900, expected_output_tokens=16, block_size=BLOCK)


def worker(worker_id: str, **fields) -> WorkerView:
    role = "prefill" if worker_id.startswith("p") else "decode"
    defaults = dict(num_running=0, num_waiting=0, num_queued_prefill_tokens=0, num_free_blocks=1000,
                    num_total_blocks=1000, block_size=BLOCK, bytes_per_block=BLOCK * 23_040)
    return WorkerView(worker_id, role, **{**defaults, **fields})


def binding(*cores: int, machine: str = "boot-a") -> wire.CoreBinding:
    return wire.CoreBinding(machine=machine, cores=cores)


# ---------------------------------------------------------------- what a worker reports


@pytest.mark.parametrize("text, cores", [
    ("0", (0,)), ("0-3", (0, 1, 2, 3)), ("2,0", (0, 2)), ("0-1|2-3", (0, 1, 2, 3)),  # ranks joined by |
    (None, ()), ("", ()), ("auto", ()), ("all", ()), ("nobind", ()),  # vLLM's own placement: no fixed cores
])
def test_an_openmp_binding_names_its_cores(text, cores):
    assert bound_cores(text) == cores


def test_a_worker_reports_its_cores_only_when_bound_and_on_a_known_machine():
    assert core_binding("1", machine="boot-a") == binding(1)
    assert core_binding("auto", machine="boot-a") is None
    assert core_binding("1", machine="") is None  # unknown kernel: core 1 might be anyone's


def test_the_machine_is_the_running_kernel(tmp_path):
    boot_id = tmp_path / "boot_id"
    boot_id.write_text("3f2a\n")
    assert machine_id(str(boot_id)) == "3f2a"
    assert machine_id(str(tmp_path / "missing")) == ""


# ---------------------------------------------------------------- which neighbours the planner sees


def test_busy_engines_on_a_shared_core_are_attached_and_idle_ones_are_not():
    views = [worker("p0"), worker("p1", num_queued_prefill_tokens=300), worker("d0", in_flight=2),
             worker("d1")]
    bindings = {"p0": binding(0), "p1": binding(1), "d0": binding(0), "d1": binding(1)}
    by_id = {view.worker_id: view for view in with_core_neighbours(views, bindings)}
    assert [n.worker_id for n in by_id["p0"].core_neighbours] == ["d0"]
    assert [n.worker_id for n in by_id["d1"].core_neighbours] == ["p1"]
    assert by_id["p1"].core_neighbours == ()  # d1 shares its core but is idle
    assert by_id["d0"].core_neighbours == ()  # p0 shares its core but is idle


def test_only_the_same_machine_and_overlapping_cores_count():
    views = [worker("p0"), worker("d0", num_running=1), worker("d1", num_running=1), worker("d2", num_running=1)]
    bindings = {"p0": binding(0, 1), "d0": binding(1), "d1": binding(0, machine="boot-b"), "d2": binding(2)}
    by_id = {view.worker_id: view for view in with_core_neighbours(views, bindings)}
    assert [n.worker_id for n in by_id["p0"].core_neighbours] == ["d0"]


def test_workers_without_a_binding_share_nothing():
    views = [worker("p0"), worker("d0", num_running=3)]
    assert with_core_neighbours(views, {"d0": binding(0)}) == views
    assert with_core_neighbours(views, {}) == views


# ---------------------------------------------------------------- what sharing costs


def test_a_decoding_neighbour_doubles_a_prefill_and_a_prefilling_one_adds_its_queue():
    decoding = worker("d0", num_running=1)
    prefilling = worker("p1", num_queued_prefill_tokens=1000)
    queued = cost.queued_prefill_seconds(MODEL, prefilling)
    assert cost.neighbour_busy_seconds(MODEL, decoding) == math.inf
    # sent by this orchestrator, not in its heartbeat yet (or still prefilling elsewhere)
    assert cost.neighbour_busy_seconds(MODEL, worker("d0", in_flight=1)) == math.inf
    assert cost.neighbour_busy_seconds(MODEL, worker("d0")) == 0.0
    assert cost.contention_seconds(MODEL, worker("p0", core_neighbours=(decoding,)), 2.0) == 2.0
    # processor sharing: P alongside B ends after P + min(B, P)
    assert cost.contention_seconds(MODEL, worker("p0", core_neighbours=(prefilling,)), 10 * queued) == \
        pytest.approx(queued)
    assert cost.contention_seconds(MODEL, worker("p0", core_neighbours=(prefilling,)), queued / 2) == \
        pytest.approx(queued / 2)
    assert cost.contention_seconds(MODEL, worker("p0", core_neighbours=(decoding, prefilling)), 0.0) == 0.0


def test_a_shared_core_shows_in_the_estimate_and_its_reason():
    decode = worker("d0", num_running=8)  # a LOCAL prefill would stall eight streams
    decision = CacheAwarePlanner().decide(REQUEST, [worker("p0", core_neighbours=(decode,))], [decode], MODEL)
    estimate = decision.chosen.estimate
    assert decision.chosen.kind is PlanKind.DISAGG
    assert estimate.contention == pytest.approx(estimate.queue_wait + estimate.prefill)
    assert estimate.ttft == pytest.approx(estimate.queue_wait + estimate.prefill + estimate.contention)
    assert f"{estimate.contention:.3f} s of it for engines sharing its cores" in decision.reason


# ---------------------------------------------------------------- what the planner does


def decide(prefill, decode):
    return CacheAwarePlanner().decide(REQUEST, prefill, decode, MODEL)


def test_a_cold_prefill_goes_to_the_worker_alone_on_its_core():
    decode = worker("d0", num_running=2)
    shared = worker("p0", core_neighbours=(decode,))
    alone = worker("p1")
    assert decide([shared, alone], [decode]).chosen.prefill_worker == "p1"
    assert decide([dataclasses.replace(shared, core_neighbours=()), alone], [decode]).chosen.prefill_worker == "p0"


def test_a_warm_worker_on_a_shared_core_still_wins_when_the_reuse_saves_more():
    decode = worker("d0", num_running=2)
    warm_shared = worker("p0", cached_blocks=55, core_neighbours=(decode,))
    assert decide([warm_shared, worker("p1")], [decode]).chosen.prefill_worker == "p0"


def test_a_local_prefill_pays_for_a_busy_prefill_worker_on_the_decode_workers_core():
    busy_prefill = worker("p0", num_queued_prefill_tokens=4000, num_running=1)
    decode = worker("d0", cached_blocks=50)
    alone = decide([busy_prefill, worker("p1", num_queued_prefill_tokens=4000)], [decode])
    shared = decide([busy_prefill, worker("p1", num_queued_prefill_tokens=4000)],
                    [dataclasses.replace(decode, core_neighbours=(busy_prefill,))])
    assert alone.chosen.kind is shared.chosen.kind is PlanKind.LOCAL
    assert shared.chosen.estimate.ttft > alone.chosen.estimate.ttft
    assert shared.chosen.estimate.contention == pytest.approx(shared.chosen.estimate.prefill)


# ---------------------------------------------------------------- what is learned from it


def observed_prefills(contention: float) -> int:
    calibration = Calibration()
    loop = Feedback(index_sync=None, calibration=calibration, metrics=Metrics())
    estimate = Estimate(queue_wait=0.0, prefill=1.0, transfer=0.0, ttft=1.0 + contention, gap=0.05,
                        reused_tokens=0, transfer_bytes=0, contention=contention)
    plan = Plan(PlanKind.DISAGG, decode_worker="d0", prefill_worker="p0", estimate=estimate)
    record = DecisionRecord(response_id="chatcmpl-1", choice_index=0, request_id="req", policy="cache_aware",
                            prompt_tokens=900, block_size=BLOCK, predicted_reused_tokens=0, reason="test",
                            chosen=None, alternatives=[])
    record.actual.reused_tokens, record.actual.ttft = 0, 2.0
    loop.observe(plan, record, idle_at_start=True)
    return len(calibration.prefill._observations.get("prefill", ()))


def test_a_prefill_slowed_by_a_neighbour_does_not_calibrate_the_workers_own_speed():
    assert observed_prefills(contention=0.0) == 1
    assert observed_prefills(contention=1.0) == 0


# ---------------------------------------------------------------- the simulator reports the same


def test_simulated_pinned_engines_report_their_cores_as_workers_do():
    ids = ["prefill-0", "prefill-1", "decode-0"]
    bindings = core_bindings(Cores(CpuSettings(cores=2), ids))
    assert [bindings[i].cores for i in ids] == [(0,), (1,), (0,)]
    assert len({b.machine for b in bindings.values()}) == 1
    assert core_bindings(Cores(CpuSettings(cores=2, pinned=False), ids)) == {}
    assert core_bindings(Cores(CpuSettings(), ids)) == {}
