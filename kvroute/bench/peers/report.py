"""What a peers sweep measured, judged: SLO attainment, goodput, the winner of every metric, and
kvroute against the best peer. Pure functions over ``replay.Row``s and plain dicts.

* A request **meets the SLO** when it succeeded, its TTFT is at most the TTFT target and its
  TPOT (``Row.itl_s``: (last − first token) / (tokens − 1)) at most the TPOT target; a
  one-token answer has no TPOT and is judged on TTFT alone. Failed and lost requests count
  against it: the share is over every request sent.
* **Goodput** of a system on a workload is the largest swept rate at which at least
  ``Targets.attainment`` (90%) of the requests met the SLO; None when no rate did.
* The **winner** of a metric is the system with the best value (lowest latency, highest hit
  rate and goodput); equal values share the win. ``kvroute_over_best_peer`` is kvroute's
  value over the best other system's: below 1 is better for latencies, above 1 for hit rate
  and goodput. Every verdict names the winner, also when it is a peer. ``kvroute-tier`` (kvroute
  with a node KV tier) is no peer: ``tier_over_kvroute`` is its value over kvroute's.
* **By round**: with ``--repeats``, the k-th run of every system is its k-th round, run one
  after another (``run.measure_systems``). ``kvroute_over_best_peer_by_round`` is kvroute's
  value over the best peer's of the same round, round by round, and ``median_by_round`` their
  median: now and then a whole run is slow (measured on two cores: one run of four at ~1.8x
  its TPOT P50, for kvroute and for vLLM, with as much CPU time spent as in the others), and
  the pooled percentiles then judge whichever system that run was.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from kvroute.bench.peers.plans import KVROUTE, KVROUTE_TIER
from kvroute.bench.replay import Row
from kvroute.bench.replay_results import hit_rate
from simulator.records import percentile

OURS = (KVROUTE, KVROUTE_TIER)  # kvroute-tier is compared with kvroute, not counted as a peer


@dataclass(frozen=True)
class Targets:
    ttft_s: float = 1.0
    tpot_s: float = 0.15
    attainment: float = 0.9

    def __post_init__(self):
        if self.ttft_s <= 0 or self.tpot_s <= 0 or not 0 < self.attainment <= 1:
            raise ValueError("targets must be positive and the attainment in (0, 1]")


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    lower_is_better: bool
    unit: str  # "s", "%" or "rps"


RUN_METRICS = (Metric("ttft_p50_s", "TTFT P50", True, "s"), Metric("ttft_p99_s", "TTFT P99", True, "s"),
               Metric("tpot_p50_s", "TPOT P50", True, "s"), Metric("tpot_p99_s", "TPOT P99", True, "s"),
               Metric("e2e_p50_s", "E2E P50", True, "s"), Metric("hit_rate", "hit rate", False, "%"))
GOODPUT = Metric("goodput_rps", "goodput", False, "rps")
NO_VALUE = {GOODPUT.key: "no system met the bar at any swept rate"}


def meets_slo(row: Row, targets: Targets) -> bool:
    if not row.succeeded or row.ttft_s > targets.ttft_s:
        return False
    return row.itl_s is None or row.itl_s <= targets.tpot_s


def run_metrics(rows: list[Row], duration_s: float, targets: Targets,
                lengths: dict[int, int | None] | None = None) -> dict:
    """One system's run of one workload at one rate."""
    ok = [r for r in rows if r.succeeded]
    lost = sum(r.status == 0 for r in rows)  # never answered: refused connection, timeout
    met = sum(meets_slo(r, targets) for r in rows)
    attainment = met / len(rows) if rows else 0.0
    lengths = lengths or {}
    short = sum(1 for r in ok if lengths.get(r.index) and r.completion_tokens != lengths[r.index])

    def pct(key: str, q: float) -> float | None:
        return percentile([getattr(r, key) for r in ok if getattr(r, key) is not None], q)

    return {"requests": len(rows), "succeeded": len(ok), "errors": len(rows) - len(ok), "lost": lost,
            "ttft_p50_s": pct("ttft_s", 50), "ttft_p99_s": pct("ttft_s", 99),
            "tpot_p50_s": pct("itl_s", 50), "tpot_p99_s": pct("itl_s", 99), "e2e_p50_s": pct("e2e_s", 50),
            "hit_rate": hit_rate(ok), "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
            "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
            "outputs_not_of_requested_length": short, "slo_met": met, "slo_attainment": attainment,
            "meets_goodput_bar": bool(rows) and attainment >= targets.attainment,
            "duration_s": duration_s, "throughput_rps": len(ok) / duration_s if duration_s > 0 else None,
            "max_send_lateness_s": max((r.sent_s - r.scheduled_s for r in rows), default=None)}


def goodput(metrics_by_rate: dict[float, dict]) -> float | None:
    """The largest rate whose run met the goodput bar; None if none did."""
    passing = [rate for rate, metrics in metrics_by_rate.items() if metrics.get("meets_goodput_bar")]
    return max(passing) if passing else None


def winners(values: dict[str, float | None], lower_is_better: bool) -> list[str]:
    """The systems with the best value (several on a tie); none without values."""
    known = {name: value for name, value in values.items() if value is not None}
    if not known:
        return []
    best = min(known.values()) if lower_is_better else max(known.values())
    return [name for name, value in known.items() if value == best]


def compare(values: dict[str, float | None], metric: Metric) -> dict:
    """Winner(s), and kvroute against the best other system, with a sentence saying so."""
    result: dict = {"metric": metric.key, "values": values, "winners": winners(values, metric.lower_is_better)}
    peers = {name: value for name, value in values.items() if name not in OURS}
    best_peers = winners(peers, metric.lower_is_better)
    ours = values.get(KVROUTE)
    if ours and values.get(KVROUTE_TIER) is not None:
        result["tier_over_kvroute"] = values[KVROUTE_TIER] / ours
    if best_peers:
        result["best_peer"] = best_peers[0]
        result["best_peer_value"] = peers[best_peers[0]]
        if ours is not None and peers[best_peers[0]]:
            result["kvroute_over_best_peer"] = ours / peers[best_peers[0]]
    result["verdict"] = verdict(metric, result)
    return result


def by_round(rounds: dict[str, tuple[dict, ...]], metric: Metric) -> list[float]:
    """kvroute's value over the best peer's in each round both have one; [] without kvroute."""
    ours, out = rounds.get(KVROUTE, ()), []
    for k, run in enumerate(ours):
        peers = {name: runs[k].get(metric.key) for name, runs in rounds.items() if name not in OURS and k < len(runs)}
        best = winners(peers, metric.lower_is_better)
        if best and run.get(metric.key) is not None and peers[best[0]]:
            out.append(run[metric.key] / peers[best[0]])
    return out


def with_rounds(comparison: dict, ratios: list[float]) -> dict:
    """``comparison`` with its round-by-round ratios (two rounds or more) said in its verdict."""
    if len(ratios) < 2:
        return comparison
    middle = statistics.median(ratios)
    shown = " ".join(f"{ratio:.2f}x" for ratio in ratios)
    return {**comparison, "kvroute_over_best_peer_by_round": ratios, "median_by_round": middle,
            "verdict": f"{comparison['verdict']}; by round {shown} (median {middle:.2f}x)"}


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value * 1000:.0f} ms"
    if unit == "%":
        return f"{value:.1%}"
    return f"{value:g} req/s"


def verdict(metric: Metric, comparison: dict) -> str:
    """E.g. "TTFT P50: vllm wins (88 ms); kvroute 132 ms, 1.50x vllm"."""
    values, won = comparison["values"], comparison["winners"]
    if not won:
        return f"{metric.label}: {NO_VALUE.get(metric.key, 'no system has a value')}"
    wins = "win" if len(won) > 1 else "wins"
    lead = f"{metric.label}: {' and '.join(won)} {wins} ({fmt(values[won[0]], metric.unit)})"
    if KVROUTE not in values or "best_peer" not in comparison:
        return lead
    peer, ratio = comparison["best_peer"], comparison.get("kvroute_over_best_peer")
    ours = fmt(values[KVROUTE], metric.unit)
    if KVROUTE in won and len(won) == 1:
        against = f"{ratio:.2f}x " if ratio is not None else "against "
        return f"{lead}; {against}the best peer, {peer} ({fmt(comparison['best_peer_value'], metric.unit)})"
    if KVROUTE in won:
        return lead
    return f"{lead}; kvroute {ours}" + (f", {ratio:.2f}x {peer}" if ratio is not None else "")


def comparisons(metrics: dict[str, dict[str, dict[float, dict]]],
                rounds: dict[str, dict[str, dict[float, tuple[dict, ...]]]] | None = None) -> dict:
    """``metrics[system][workload][rate]`` → per workload: goodput per system and its comparison,
    and per rate one comparison per run metric; ``rounds`` (same keys, each run's metrics in
    order) adds the round-by-round ratios (``with_rounds``)."""
    workloads = sorted({w for per_system in metrics.values() for w in per_system})
    rounds = rounds or {}
    out: dict = {}
    for workload in workloads:
        ran = {system: runs[workload] for system, runs in metrics.items() if workload in runs}
        goodputs = {system: goodput(by_rate) for system, by_rate in ran.items()}
        rates = sorted({rate for by_rate in ran.values() for rate in by_rate})
        out[workload] = {"goodput": compare(goodputs, GOODPUT), "rates": {}}
        for rate in rates:
            in_rounds = {s: runs.get(workload, {}).get(rate, ()) for s, runs in rounds.items()}
            out[workload]["rates"][rate] = {
                metric.key: with_rounds(compare({s: ran[s].get(rate, {}).get(metric.key) for s in ran}, metric),
                                        by_round(in_rounds, metric))
                for metric in RUN_METRICS}
    return out


def kv_aware_credits(router_log: str) -> dict:
    """How many of a kv_aware router's decisions credited a cached prefix (its debug log's
    ``credited_prefix_tokens``): zero means its KV index never matched a prompt."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", router_log)  # the router colours its log even into a file
    credited = [int(n) for n in re.findall(r"credited_prefix_tokens=(\d+)", plain)]
    return {"decisions": len(credited), "credited_decisions": sum(n > 0 for n in credited),
            "credited_tokens": sum(credited)}
