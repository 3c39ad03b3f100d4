"""The simulated part of the results page: every policy at every size on both workloads,
the targets judged on each, what a node KV tier adds to some of them, and the real-cluster
sections with their validation tables."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from kvroute.bench.progress import track
from kvroute.bench.replay_results import ratios
from kvroute.bench.results_page.setup import Setup
from kvroute.bench.simulation import validate
from kvroute.bench.simulation.real_run import is_trace_run, load_real, rebuild_requests
from kvroute.bench.simulation.simulate import bounds
from orchestrator.planner.policies import POLICIES
from simulator import SimCalibration, SimulationSettings, TierSettings, simulate
from simulator.from_replay import calibration_from_replay, cluster_from_replay
from simulator.requests import replay_requests
from simulator.scaling import cold_prefill_seconds, scale_repository_assistant, trace_time_scale
from workloads import generate_workload
from workloads.trace import TraceScaling, read_trace, scale_trace

SIZES, QUICK_SIZES = (1, 4, 32, 500), (1, 4)  # prefill workers; as many decode workers
REQUESTS_PER_PREFILL, MAX_REQUESTS = 100, 50_000
QUICK_REQUESTS_PER_PREFILL, QUICK_TRACE_RECORDS = 10, 100
CDF_WORKERS = 8
console = Console()  # the progress of the simulations
REPOSITORY, TRACE = "repository-assistant", "trace"
# The node tier's runs: these policies again, with a store on every node of
# ``TierSettings().workers_per_node`` workers holding TIER_MULTIPLE times its engines' KV
# in host memory (no disk tier).
TIER_POLICIES, TIER_MULTIPLE = ("cache_aware", "round_robin"), 8


@dataclass(frozen=True)
class Target:
    workload: str
    name: str
    key: str  # a field of a size's row
    bound: float
    at_least: bool  # True: value >= bound passes; False: value <= bound
    kind: str = "x"  # how the page shows the value: a ratio ("x") or a share ("%")

    def judge(self, row: dict) -> dict:
        value = row.get(self.key)
        passed = value is not None and (value >= self.bound if self.at_least else value <= self.bound)
        return {"target": self.name, "value": value, "bound": self.bound, "pass": passed, "kind": self.kind}


TARGETS = (
    Target(REPOSITORY, "cache_aware/round_robin P50 TTFT <= 0.25", "p50_ratio", 0.25, False),
    Target(REPOSITORY, "cache_aware/best baseline P99 TTFT <= 1", "p99_ratio", 1.0, False),
    Target(TRACE, "cache_aware reused tokens >= 90% of the shared LRU's", "of_lru", 0.9, True, "%"),
    Target(TRACE, "(stricter reading) >= 90% of the unlimited bound's", "of_unlimited", 0.9, True, "%"),
    Target(TRACE, "cache_aware/round_robin P50 TTFT <= 0.8", "p50_ratio", 0.8, False),
    Target(TRACE, "cache_aware/best baseline P99 TTFT <= 1", "p99_ratio", 1.0, False),
)


def run_size(source, num_prefill: int, settings: SimulationSettings, calibration: SimCalibration) -> tuple[dict, dict]:
    """Every policy on ``num_prefill`` + ``num_prefill`` workers: the size's row, and TTFTs by policy."""
    engine = settings.prefill_engine
    oracle = bounds(source, SimpleNamespace(block_size=engine.block_size, kv_blocks=engine.num_blocks,
                                            prefill=num_prefill, decode=num_prefill))
    policies, ttfts = {}, {}
    for policy in track(POLICIES, "policies", console):
        result = simulate(source, policy, num_prefill, num_prefill, calibration, 0, settings)
        s = result.summary
        policies[policy] = {"ttft_p50_s": s.ttft_p50, "ttft_p99_s": s.ttft_p99, "hit_rate": s.hit_rate,
                            "cached_tokens": s.cached_tokens, "finished": s.finished, "rejected": s.rejected,
                            "of_lru": share(s.cached_tokens, oracle["lru_all_workers"]["reused_tokens"]),
                            "of_unlimited": share(s.cached_tokens, oracle["unlimited"]["reused_tokens"]),
                            "of_prefill_lru": share(s.cached_tokens, oracle["lru_prefill_pool"]["reused_tokens"]),
                            "wall_seconds": result.wall_seconds}
        ttfts[policy] = [r.ttft_seconds for r in result.records if r.ttft_seconds is not None]
        print(f"  {2 * num_prefill} workers, {policy}: {result.wall_seconds:.1f} s", flush=True)
    row = {"workers": 2 * num_prefill, "num_prefill": num_prefill, "num_decode": num_prefill, "oracle": oracle,
           "policies": policies, "wall_seconds": sum(p["wall_seconds"] for p in policies.values())}
    return row | summary_ratios(policies) | {"tier": tier_runs(source, num_prefill, settings, calibration)}, ttfts


def node_tier(settings: SimulationSettings, num_workers: int) -> TierSettings:
    """A store per node whose host memory holds ``TIER_MULTIPLE`` times the KV of its engines."""
    per_node = min(TierSettings().workers_per_node or num_workers, num_workers)
    engines = (settings.prefill_engine.num_blocks + settings.decode_engine.num_blocks) / 2
    return TierSettings(host_blocks=int(TIER_MULTIPLE * engines * per_node))


def tier_runs(source, num_prefill: int, settings: SimulationSettings, calibration: SimCalibration) -> dict:
    """``TIER_POLICIES`` on the same cluster with node stores: the side of the comparison with a tier."""
    tier = node_tier(settings, 2 * num_prefill)
    policies = {}
    for policy in TIER_POLICIES:
        result = simulate(source, policy, num_prefill, num_prefill, calibration, 0, replace(settings, tier=tier))
        s = result.summary
        policies[policy] = {"ttft_p50_s": s.ttft_p50, "ttft_p99_s": s.ttft_p99, "hit_rate": s.hit_rate,
                            "tier_hit_rate": s.tier_hit_rate, "finished": s.finished, "rejected": s.rejected,
                            "wall_seconds": result.wall_seconds}
        print(f"  {2 * num_prefill} workers, {policy} with node stores: {result.wall_seconds:.1f} s", flush=True)
    return {"settings": asdict(tier), "multiple": TIER_MULTIPLE, "policies": policies}


def workers(num_prefill: int) -> str:
    return f"{2 * num_prefill} workers"


def share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def summary_ratios(policies: dict[str, dict]) -> dict:
    return target_ratios(ratios(policies)) | {"of_lru": policies["cache_aware"]["of_lru"],
                                              "of_unlimited": policies["cache_aware"]["of_unlimited"]}


def target_ratios(found: dict) -> dict:
    """``replay_results.ratios`` under the names the targets judge."""
    return {"p50_ratio": found.get("cache_aware_over_round_robin_p50_ttft"),
            "p99_ratio": found.get("cache_aware_over_best_baseline_p99_ttft"),
            "best_baseline_p99": found.get("best_baseline_p99_ttft")}


def repository_runs(setup: Setup, sizes, per_prefill: int) -> tuple[list[dict], dict]:
    rows, cdf = [], {}
    for num_prefill in track(sizes, f"{REPOSITORY} sizes", console, name=workers):
        requests = min(per_prefill * num_prefill, MAX_REQUESTS)
        config = scale_repository_assistant(setup.repository, setup.reference_prefill, num_prefill, requests)
        workload = replay_requests(generate_workload(config))  # token ids once, for the oracle and every policy
        row, ttfts = run_size(workload, num_prefill, setup.repository_settings, setup.calibration)
        rows.append(row | {"requests": requests, "workload": asdict(config),
                           "requests_per_repository": requests / config.repositories,
                           "cold_prefill_load": cold_load(workload, num_prefill, setup.calibration)})
        cdf = ttfts if row["workers"] == CDF_WORKERS else cdf
    return rows, cdf


def trace_runs(setup: Setup, path: Path, sizes, limit: int | None) -> tuple[list[dict], dict]:
    records = read_trace(path, limit)
    prompts = [r.prompt_tokens for r in scale_trace(records).requests]
    rows, cdf = [], {}
    for num_prefill in track(sizes, f"{TRACE} sizes", console, name=workers):
        scale = trace_time_scale(prompts, num_prefill, setup.calibration)
        trace = scale_trace(records, TraceScaling(time_scale=scale))
        row, ttfts = run_size(trace, num_prefill, setup.trace_settings, setup.calibration)
        rows.append(row | {"requests": trace.kept, "dropped": trace.dropped, "time_scale": scale,
                           "trace_seconds": trace.requests[-1].arrival_seconds,
                           "cold_prefill_load": cold_load(trace.requests, num_prefill, setup.calibration)})
        cdf = ttfts if row["workers"] == CDF_WORKERS else cdf
    return rows, cdf


def cold_load(requests, num_prefill: int, calibration: SimCalibration) -> float:
    """Prefill seconds per second per prefill worker, were nothing ever cached."""
    span = max(r.arrival_seconds for r in requests)
    return cold_prefill_seconds((r.prompt_tokens for r in requests), calibration) / (num_prefill * span)


def judge_targets(workloads: dict[str, list[dict]]) -> None:
    for workload, rows in workloads.items():
        for row in rows:
            row["targets"] = [target.judge(row) for target in TARGETS if target.workload == workload]


def validation(real: Path) -> dict:
    """The real run's summaries and ``kvroute bench validate-simulator``'s model table (simulated vs real);
    a trace run's sample, bounds and targets."""
    args = validate.parse_args(["--real", str(real)])
    results, decisions, _ = load_real(real)
    out = {"source": str(real), "summaries": results["summaries"], "ratios": results["ratios"],
           "workers": results["workers"]}
    if is_trace_run(results):
        out |= {"trace": results["trace"] | {"family_fraction": results["settings"]["family_fraction"]},
                "targets": real_targets(TRACE, results["summaries"], results["ratios"])}
    else:
        out |= {"workload": results["workload"]["config"],
                "targets": real_targets(REPOSITORY, results["summaries"], results["ratios"])}
    try:
        requests, check = rebuild_requests(results)  # needs the model's tokenizer
    except (ImportError, OSError) as error:
        return out | {"validation_error": f"{type(error).__name__}: {error}"}
    cluster = cluster_from_replay(results, decisions)
    simulated = validate.simulate_all(requests, list(results["summaries"]), cluster,
                                                calibration_from_replay(results, decisions), cluster.settings(),
                                                args.seeds)
    return out | {"request_check": check, "band": args.band, "seeds": args.seeds,
                  "comparison": validate.compare(results, simulated, args.band)}


def real_targets(workload: str, summaries: dict[str, dict], found: dict) -> list[dict]:
    """A workload's targets judged on a real run (a trace run's summaries carry the shares of the bounds)."""
    cache_aware = summaries.get("cache_aware", {})
    row = target_ratios(found) | {"of_lru": cache_aware.get("of_lru_all_workers"),
                                  "of_unlimited": cache_aware.get("of_unlimited")}
    return [target.judge(row) for target in TARGETS if target.workload == workload]
