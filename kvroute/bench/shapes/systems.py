"""The systems ``kvroute bench shapes`` compares at N engines, each a simulated run of a workload.

kvroute's candidate shapes (``candidate_shapes``), each run by the production planner
(``cache_aware``) with each role's engine as ``kvroute serve`` configures it (the per-prompt
step cap of ``worker.settings``: 256 tokens on prefill and decode workers, none on unified):

* ``Nu``: N unified engines;
* ``kp(N−k)d`` for k = N/8 and N/4 (at least one of each): a prefill pool and a decode pool;
* ``(N/2)u(N/8)p(3N/8)d`` from 8 engines on: half unified, the rest split.

The peers (``simulator.peers``), on engines as a plain vLLM server configures them (no cap):

* ``router-hash``: N replicas behind a prefix-hash router (no KV moves, no load);
* ``router-affinity``: N replicas behind an SGLang-style cache-aware router (the best prefix
  match while loads are balanced, else the least loaded: the planner's ``prefix_affinity``);
* ``one-engine``: one vLLM server on the whole machine (perfect scaling, its best case).

And a reference that is no prefix-affinity router, shown so no cheaper win is hidden:
``router-round-robin``, N replicas in turn (vllm-router's default policy).

Every engine has the same KV blocks (``EngineConfig().num_blocks``; the one engine N times
as many), so shapes compare at equal total KV memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvroute.bench.peers.sources import SourceSettings, generator_choice
from kvroute.bench.replay_sources import WORKLOADS
from kvroute.topology import parse_spec, spec_of
from orchestrator.planner.settings import PlannerSettings
from simulator import EngineConfig, SimCalibration, SimulationResult, SimulationSettings, simulate
from simulator.peers import PrefixHashRouter, one_engine_machine
from simulator.stopping import StopRule
from worker.settings import default_long_prefill_tokens
from workloads import WorkloadRequest

KVROUTE, PEER, REFERENCE = "kvroute", "peer", "reference"
KVROUTE_POLICY = "cache_aware"
VLLM_MAX_NUM_SEQS = 256  # vLLM's default batch limit on most GPUs
# What the peers' routers hold back: nothing, up to the engines' batch limit.
ROUTER = PlannerSettings(max_in_flight=VLLM_MAX_NUM_SEQS)
WORKLOAD = "long-output"

# A run of requests; the stop rule may end it once its verdict is settled.
Run = Callable[[list[WorkloadRequest], StopRule | None], SimulationResult]


@dataclass(frozen=True)
class System:
    name: str  # the table's row: a shape for kvroute, a peer's name
    kind: str  # KVROUTE | PEER | REFERENCE
    shape: str  # the engines it runs on, as a topology spec
    run: Run


def long_output(rate: float, seconds: float, seed: int = 0) -> list[WorkloadRequest]:
    """``kvroute bench peers``' long-output workload, ``seconds`` of it at ``rate`` requests/s."""
    requests = max(1, math.ceil(rate * seconds))
    name, choice = generator_choice(WORKLOAD, rate, SourceSettings(requests=requests, seed=seed))
    return WORKLOADS[name](choice)


def candidate_shapes(engines: int) -> list[str]:
    """kvroute's shapes at ``engines`` engines (see the module docstring), unified first."""
    if engines < 1:
        raise ValueError("a machine needs at least one engine")
    shapes = [f"{engines}u"]
    for prefill in sorted({max(1, engines // 8), max(1, engines // 4)}):
        if engines - prefill >= 1:
            shapes.append(f"{prefill}p{engines - prefill}d")
    if engines >= 8:
        shapes.append(spec_of({"prefill": engines // 8, "decode": engines // 2 - engines // 8,
                               "unified": engines // 2}))
    return list(dict.fromkeys(shapes))


def kvroute_engines() -> dict[str, EngineConfig]:
    """Each role's engine as ``kvroute serve`` starts it."""
    return {role: EngineConfig(long_prefill_tokens=default_long_prefill_tokens(role))
            for role in ("prefill", "decode", "unified")}


def kvroute_system(shape: str, calibration: SimCalibration, tpot_target: float) -> System:
    """``shape`` under the production planner, told the TPOT target it is judged by (as a user
    would start ``kvroute serve --tpot-target-seconds``)."""
    counts, engines = parse_spec(shape), kvroute_engines()
    settings = SimulationSettings(prefill_engine=engines["prefill"], decode_engine=engines["decode"],
                                  unified_engine=engines["unified"], tpot_target_seconds=tpot_target)

    def run(requests: list[WorkloadRequest], stop: StopRule | None = None) -> SimulationResult:
        return simulate(requests, KVROUTE_POLICY, counts["prefill"], counts["decode"], calibration,
                        settings=settings, num_unified=counts["unified"], stop=stop)

    return System(spec_of(counts), KVROUTE, spec_of(counts), run)


def replicas(name: str, kind: str, engines: int, calibration: SimCalibration,
             router: Callable[[], object] | str) -> System:
    """``engines`` plain vLLM replicas (unified workers, no cap) behind ``router``: a policy
    name, or a factory of a fresh policy object per run. A router holds nothing back
    (``ROUTER``): a replica takes requests up to its engine's batch limit, whatever
    kvroute's own caps."""
    settings = SimulationSettings(planner=ROUTER)

    def run(requests: list[WorkloadRequest], stop: StopRule | None = None) -> SimulationResult:
        policy = router if isinstance(router, str) else router()
        return simulate(requests, policy, 0, 0, calibration, settings=settings, num_unified=engines, stop=stop)

    return System(name, kind, f"{engines}u", run)


def one_engine(engines: int, calibration: SimCalibration) -> System:
    faster, engine = one_engine_machine(calibration, EngineConfig(), engines)

    def run(requests: list[WorkloadRequest], stop: StopRule | None = None) -> SimulationResult:
        return simulate(requests, "round_robin", 0, 0, faster,
                        settings=SimulationSettings(unified_engine=engine, planner=ROUTER), num_unified=1, stop=stop)

    return System("one-engine", PEER, f"1u (x{engines})", run)


def systems(engines: int, calibration: SimCalibration, tpot_target: float,
            shapes: list[str] | None = None) -> list[System]:
    """kvroute's shapes, then the peers, then the reference, at ``engines`` engines."""
    ours = [kvroute_system(shape, calibration, tpot_target) for shape in shapes or candidate_shapes(engines)]
    return [*ours,
            replicas("router-hash", PEER, engines, calibration, PrefixHashRouter),
            replicas("router-affinity", PEER, engines, calibration, "prefix_affinity"),
            one_engine(engines, calibration),
            replicas("router-round-robin", REFERENCE, engines, calibration, "round_robin")]


def split(shape: str) -> bool:
    """Whether ``shape`` splits prefill from decode (has a prefill or a decode worker)."""
    counts = parse_spec(shape)
    return bool(counts["prefill"] or counts["decode"])

