"""TPOT targets: what a request asks for, and how the planner charges a prefill that would
push the streams decoding beside it past theirs. LOCAL stays chosen where it is free; a
disaggregated plan wins where LOCAL would break targets."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from orchestrator.api import TPOT_TARGET_HEADER, ApiContext
from orchestrator.errors import APIError
from orchestrator.planner import cost_model as cost
from orchestrator.planner.cost_model import CostModel
from orchestrator.planner.planner import CacheAwarePlanner
from orchestrator.planner.settings import DEFAULT_TPOT_TARGET_SECONDS
from orchestrator.planner.views import DecodeStream, PlanKind, RequestView, WorkerView
from orchestrator.settings import OrchestratorSettings

BLOCK = 16
REQUEST = RequestView("r1", prompt_tokens=900, expected_output_tokens=64, block_size=BLOCK)  # 57 blocks


def worker(worker_id: str, **fields) -> WorkerView:
    role = "prefill" if worker_id.startswith("p") else "decode"
    defaults = dict(num_running=0, num_waiting=0, num_queued_prefill_tokens=0, num_free_blocks=1000,
                    num_total_blocks=1000, block_size=BLOCK, bytes_per_block=BLOCK * 23_040)
    return WorkerView(worker_id, role, **{**defaults, **fields})


def streams(count: int, target: float = 0.15, slack: float = 0.02, decoded: int = 100,
            left: int = 20) -> tuple[DecodeStream, ...]:
    """``count`` streams at a steady pace that ends their lives ``slack`` seconds within ``target``."""
    pace = (target * (decoded + left) - slack) / (decoded + left)
    return tuple(DecodeStream(target, decoded, pace * decoded, left) for _ in range(count))


def decide(decode: WorkerView):
    """A cold prefill worker against ``decode``, which holds 50 of the prompt's 57 blocks."""
    return CacheAwarePlanner().decide(REQUEST, [worker("p0")], [decode], CostModel())


# ---------------------------------------------------------------- one stream's overrun

@pytest.mark.parametrize("stream, stall, expected", [
    (DecodeStream(0.15, 100, 10.0, 20), 0.5, 0.0),  # 0.1 s a token: 6 s of slack
    (streams(1, slack=0.02)[0], 0.1, 0.08),  # all but its slack lands past the target
    (DecodeStream(0.05, 100, 10.0, 20), 0.5, 0.5),  # already past it: the whole stall adds to the overrun
    (DecodeStream(0.0, 100, 10.0, 20), 0.5, 0.0),  # no target
    (DecodeStream(0.05, 100, 10.0, 0), 0.5, 0.0),  # its last token is out: nothing left to stall
])
def test_a_stall_counts_past_a_target_only_for_what_exceeds_the_streams_slack(stream, stall, expected):
    assert cost.stream_overrun_seconds(stream, stall, horizon_tokens=256, usual_gap=0.02) == pytest.approx(expected)


def test_a_long_max_tokens_is_looked_at_only_as_far_as_the_expected_output():
    near_target = DecodeStream(0.15, 100, 100 * 0.149, tokens_left=4000)  # max_tokens far beyond its answer
    assert cost.stream_overrun_seconds(near_target, 0.5, horizon_tokens=4000, usual_gap=0.02) == 0.0
    assert cost.stream_overrun_seconds(near_target, 0.5, horizon_tokens=20, usual_gap=0.02) > 0.3


def test_a_stream_without_a_gap_yet_is_paced_as_the_others_on_its_worker_or_at_one_decode_step():
    fresh = DecodeStream(0.05, 0, 0.0, 10)
    assert cost.stream_overrun_seconds(fresh, 0.4, horizon_tokens=256, usual_gap=0.02) == pytest.approx(0.1)
    model = CostModel()  # a 20 ms decode step
    assert cost.worker_pace(model, worker("d0", decoding=(fresh,))) == model.decode_step_seconds
    batched = (DecodeStream(0.05, 10, 0.4, 10), DecodeStream(0.05, 10, 0.5, 10), fresh)  # 40 and 50 ms a token
    assert cost.worker_pace(model, worker("d0", decoding=batched)) == pytest.approx(0.045)


# ---------------------------------------------------------------- the ranking, both ways

@pytest.mark.parametrize("decode", [
    worker("d0", cached_blocks=50),  # nothing running: the prefill stalls nobody
    worker("d0", cached_blocks=50, num_running=8, decoding=streams(8, slack=2.0)),  # stall within their targets
])
def test_local_is_chosen_where_its_prefill_is_free_of_tpot_charges(decode):
    decision = decide(decode)
    assert decision.chosen.kind is PlanKind.LOCAL
    assert decision.chosen.estimate.tpot_overrun == 0 and "TPOT" not in decision.reason


def test_a_disaggregated_plan_wins_where_local_would_push_running_decodes_past_their_targets():
    tight = worker("d0", cached_blocks=50, num_running=8, decoding=streams(8, slack=0.02))
    decision = decide(tight)
    assert decision.chosen.kind is PlanKind.DISAGG
    local = next(plan for plan in decision.alternatives if plan.kind is PlanKind.LOCAL)
    assert local.estimate.ttft < decision.chosen.estimate.ttft  # LOCAL would answer first
    assert local.estimate.tpot_overrun > 0 and local.estimate.tpot_charge > 0
    assert "TPOT targets decide: LOCAL d0" in decision.reason
    # The same streams without targets: the stall is charged at the interference weight only, and LOCAL wins.
    untargeted = tuple(DecodeStream(0.0, s.decoded_tokens, s.decode_seconds, s.tokens_left) for s in tight.decoding)
    assert decide(worker("d0", cached_blocks=50, num_running=8, decoding=untargeted)).chosen.kind is PlanKind.LOCAL


def test_the_overrun_is_charged_in_full_and_the_rest_of_the_stall_at_the_interference_weight():
    tight = worker("d0", cached_blocks=50, num_running=8, decoding=streams(8, slack=0.02))
    charged = cost.local_interference(CostModel(), tight, 0.1, horizon_tokens=256)
    assert charged.stall == pytest.approx(0.8) and charged.tpot_overrun == pytest.approx(8 * 0.08)
    assert charged.charge == pytest.approx(0.25 * 0.8 + 0.75 * 8 * 0.08)


# ---------------------------------------------------------------- asking for a target

def request_with(headers: dict[str, str]) -> Request:
    return Request({"type": "http", "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})


def context(default: float = DEFAULT_TPOT_TARGET_SECONDS) -> ApiContext:
    return ApiContext(None, "m", 2048, "f", None, None, tpot_target_seconds=default)


def test_a_request_gets_the_default_target_unless_its_header_asks_another():
    assert context().tpot_target_for(request_with({})) == DEFAULT_TPOT_TARGET_SECONDS == 0.15
    assert context(0.0).tpot_target_for(request_with({})) == 0.0
    assert context().tpot_target_for(request_with({TPOT_TARGET_HEADER: "0.05"})) == 0.05


@pytest.mark.parametrize("value", ["fast", "0", "-0.1", "11", "nan", "inf", ""])
def test_a_target_that_is_not_seconds_within_bounds_is_a_clear_400(value):
    with pytest.raises(APIError) as refused:
        context().tpot_target_for(request_with({TPOT_TARGET_HEADER: value}))
    error = refused.value
    assert (error.status, error.param, error.code) == (400, TPOT_TARGET_HEADER, "invalid_tpot_target")
    assert "seconds per output token from 0.001 to 10" in error.message


@pytest.mark.parametrize("seconds, valid", [(0.0, True), (0.15, True), (10.0, True), (0.0001, False), (-1, False),
                                             (float("inf"), False)])
def test_the_orchestrators_default_is_no_target_or_within_the_bounds(seconds, valid):
    if valid:
        assert OrchestratorSettings(tpot_target_seconds=seconds).tpot_target_seconds == seconds
    else:
        with pytest.raises(ValueError, match="tpot_target_seconds"):
            OrchestratorSettings(tpot_target_seconds=seconds)
