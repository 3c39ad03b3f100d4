"""TPOT targets in the simulator: the decode views carry the streams decoding there, as the
orchestrator relays them, and the production planner keeps a prefill off a decode worker
whose streams it would push past their targets."""

from __future__ import annotations

from kvroute.bench.shapes.goodput import tpot_seconds
from orchestrator.planner.policies import make_policy
from simulator import simulate
from simulator.requests import TokenRequest
from simulator.simulate import SimulationSettings
from tests.unit.sim_requests import tokens

HEAD = tokens(0, 1024)
# Request 0 is prefilled on the idle decode worker, which keeps its 1,024-token head; 1-3 go
# through the prefill worker; all four then decode 200 tokens on the one decode worker. Request
# 4 extends request 0's prompt: a hit there (LOCAL), or a cold prefill on the prefill worker.
REQUESTS = [TokenRequest(0, 0.0, 200, HEAD), *(TokenRequest(i, 0.05 * i, 200, tokens(i, 256)) for i in (1, 2, 3)),
            TokenRequest(4, 1.0, 8, HEAD + tokens(9, 512))]


class Watching:
    """The cache-aware planner, keeping the decode views it was shown."""

    name = "cache_aware"

    def __init__(self):
        self.planner, self.decode_views = make_policy("cache_aware"), []

    def decide(self, request, prefill, decode, model):
        self.decode_views.append(list(decode))
        return self.planner.decide(request, prefill, decode, model)


def run(target: float, policy="cache_aware"):
    return simulate(REQUESTS, policy, 1, 1, settings=SimulationSettings(tpot_target_seconds=target)).records


def test_the_decode_view_lists_the_streams_decoding_there_with_their_target():
    watching = Watching()
    run(0.05, watching)  # the loop checks no stream is left behind at the end
    (decode,) = watching.decode_views[-1]  # request 4's decision
    assert decode.num_running == len(decode.decoding) == 4
    assert {stream.tpot_target for stream in decode.decoding} == {0.05}
    assert all(0 < stream.tokens_left < 200 for stream in decode.decoding)


def test_a_local_hit_that_would_push_the_running_streams_past_their_targets_is_prefilled_elsewhere():
    roomy, tight = run(0.15), run(0.028)  # the default; a target the streams barely keep
    assert roomy[4].plan == "local"  # its stall fits the default target: the hit wins
    assert tight[4].plan == "disagg"
    assert all(tpot_seconds(tight[i]) < tpot_seconds(roomy[i]) for i in range(4))  # not stalled
    assert tight[4].ttft_seconds > roomy[4].ttft_seconds  # paid for in the new request's TTFT
