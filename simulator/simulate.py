"""``simulate()``: one policy over one trace or workload on a simulated cluster.

    results = simulate(load_trace(path), "cache_aware", num_prefill=4, num_decode=4)
    results.summary.ttft_p50, results.summary.hit_rate, results.records[0]

The policy is built by name with the production ``make_policy``; the planner's cost model
is, unless ``settings.cost_model`` says otherwise, the one the calibration implies (what a
perfectly calibrated orchestrator would believe). ``seed`` drives everything random in a
run (step-time jitter; the trace and workload are seeded where they are made), so equal
arguments give equal results.

``settings.tier`` gives each node a KV store behind its engines' caches (``simulator.node_store``;
default: none).

``settings.cpu`` says which engines share CPU cores (``simulator.cpu``; default: none).
Where they do, every step is simulated on its own (no decode runs): a run's steps are
only identical while their pace is, and sharing changes the pace between steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from orchestrator.planner.cost_model import CostModel
from orchestrator.planner.policies import make_policy
from orchestrator.planner.settings import DEFAULT_TPOT_TARGET_SECONDS, PlannerSettings
from simulator.calibration import SimCalibration
from simulator.cpu import CpuSettings
from simulator.engine import EngineConfig
from simulator.fleet import SimFleet, check_counts
from simulator.loop import AdmissionSettings, Simulation
from simulator.node_store import StoreStats, TierSettings
from simulator.records import PolicySummary, RequestRecord, summarize
from simulator.requests import ReplayRequest, replay_requests
from simulator.sequence import ceil_div
from simulator.stopping import StopRule


@dataclass(frozen=True)
class SimulationSettings:
    prefill_engine: EngineConfig = field(default_factory=EngineConfig)
    decode_engine: EngineConfig = field(default_factory=EngineConfig)
    unified_engine: EngineConfig = field(default_factory=EngineConfig)  # for unified workers, if any
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    cost_model: CostModel | None = None  # None: calibration.cost_model()
    cpu: CpuSettings = field(default_factory=CpuSettings)  # default: no engines share cores
    # Views show vLLM's stats as of each engine's last step end, not its exact state (``fleet``).
    stats_at_step_end: bool = False
    # Indices of requests whose KV pull is refused (their decode worker prefills them again):
    # a real run's faults, replayed. Default: every pull succeeds.
    failed_pulls: frozenset[int] = frozenset()
    tier: TierSettings = field(default_factory=TierSettings)  # default: no node stores
    # Every request's TPOT target, as the orchestrator's --tpot-target-seconds (0: none).
    tpot_target_seconds: float = DEFAULT_TPOT_TARGET_SECONDS


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    role: str
    num_blocks: int
    max_blocks_used: int
    evicted_blocks: int
    preemptions: int
    steps: int


@dataclass(frozen=True)
class SimulationResult:
    policy: str
    records: list[RequestRecord]
    summary: PolicySummary
    workers: list[WorkerStats]
    simulated_seconds: float  # the clock when the last event was processed
    events: int
    wall_seconds: float
    stores: list[StoreStats] = field(default_factory=list)  # the node stores, if any
    # A stop rule ended the run before every request did (``simulator.stopping``): its records
    # are of the requests that had arrived, some still pending or running.
    stopped_early: bool = False

    def to_dict(self, with_records: bool = True) -> dict:
        result = {"policy": self.policy, "summary": self.summary.to_dict(),
                  "simulated_seconds": self.simulated_seconds, "events": self.events,
                  "wall_seconds": self.wall_seconds, "workers": [vars(w) for w in self.workers],
                  "stores": [vars(s) for s in self.stores]}
        if with_records:
            result["records"] = [r.to_dict() for r in self.records]
        return result


def simulate(trace_or_workload, policy: str = "cache_aware", num_prefill: int = 1, num_decode: int = 1,
             calibration: SimCalibration | None = None, seed: int = 0,
             settings: SimulationSettings | None = None, tokenizer=None, num_unified: int = 0,
             stop: StopRule | None = None) -> SimulationResult:
    """Replay ``trace_or_workload`` (a ``ScaledTrace``, trace requests, workload requests or
    ``TokenRequest``s) under ``policy`` (a name, or a policy object) on ``num_prefill`` +
    ``num_decode`` + ``num_unified`` workers; ``stop`` may end the run once its verdict is
    settled (``simulator.stopping``)."""
    started = time.perf_counter()
    calibration = calibration or SimCalibration()
    settings = settings or SimulationSettings()
    requests = replay_requests(trace_or_workload, tokenizer)
    counts = {"prefill": num_prefill, "decode": num_decode, "unified": num_unified}
    configs = engine_configs(settings)
    check_counts(counts)
    check_fits(requests, [configs[role] for role, count in counts.items() if count])
    fleet = SimFleet(counts, configs, calibration.bytes_per_token, settings.stats_at_step_end, settings.tier)
    policy = make_policy(policy, settings.planner) if isinstance(policy, str) else policy
    simulation = Simulation(requests, policy, fleet, calibration,
                            settings.cost_model or calibration.cost_model(), settings.admission, seed,
                            settings.cpu, settings.failed_pulls, settings.tpot_target_seconds)
    records = simulation.run(stop)
    workers = [WorkerStats(w.worker_id, w.role, w.engine.pool.num_total, w.engine.pool.max_used,
                           w.engine.pool.num_evicted, w.engine.num_preemptions, w.num_steps)
               for w in fleet.workers.values()]
    stores = [store.stats() for store in {id(store): store for store in fleet.stores.values()}.values()]
    return SimulationResult(policy.name, records, summarize(policy.name, records), workers, simulation.now,
                            simulation.clock.num_processed, time.perf_counter() - started, stores,
                            simulation.stopped_early)


def engine_configs(settings: SimulationSettings) -> dict[str, EngineConfig]:
    """Each role's engine; where engines share cores, without decode runs (see the module docstring)."""
    configs = {"prefill": settings.prefill_engine, "decode": settings.decode_engine,
               "unified": settings.unified_engine}
    if settings.cpu.shared:
        return {role: replace(config, decode_runs=False) for role, config in configs.items()}
    return configs


def check_fits(requests: list[ReplayRequest], engines: list[EngineConfig]) -> None:
    """Every request's whole life must fit one engine, or it could wait forever (vLLM
    refuses such a configuration at start-up, for its longest context)."""
    smallest = min(engine.num_blocks for engine in engines)
    block_size = engines[0].block_size
    for request in requests:
        lifetime = request.prompt_tokens + request.max_tokens
        if ceil_div(lifetime, block_size) > smallest:
            raise ValueError(f"request {request.index} needs {ceil_div(lifetime, block_size)} blocks over its "
                             f"life; the smallest engine has {smallest}")
