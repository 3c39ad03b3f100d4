"""What a shapes sweep found, judged: per engine count, each system's goodput over the best
peer's, kvroute's chosen shape, and the smallest engine count where splitting pays.

* **kvroute's chosen shape** at N engines is its candidate with the highest goodput (the
  first listed on a tie: unified before split).
* **The best peer** is the peer model with the highest goodput (the reference,
  ``router-round-robin``, is no peer, and is shown beside them).
* A ratio is a goodput over the best peer's; None where the peer met the bar at no rate
  (then any goodput of ours is a win without a finite ratio).
* **Splitting first pays** at the smallest engine count where a split kvroute shape's goodput
  is above every aggregated system's there (kvroute's ``Nu``, every peer and the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.bench.shapes.goodput import Sweep
from kvroute.bench.shapes.systems import KVROUTE, PEER, split


@dataclass(frozen=True)
class Outcome:
    name: str
    kind: str
    shape: str
    sweep: Sweep

    @property
    def goodput(self) -> float:
        """0 where no probed rate met the bar."""
        return self.sweep.goodput or 0.0

    @property
    def split(self) -> bool:
        return self.kind == KVROUTE and split(self.shape)


def best(outcomes: list[Outcome]) -> Outcome | None:
    return max(outcomes, key=lambda outcome: outcome.goodput, default=None)


def ratio(ours: float, theirs: float) -> float | None:
    return ours / theirs if theirs > 0 else None


def machine_report(engines: int, outcomes: list[Outcome]) -> dict:
    """One engine count's verdicts (see the module docstring)."""
    chosen = best([o for o in outcomes if o.kind == KVROUTE])
    peer = best([o for o in outcomes if o.kind == PEER])
    aggregated = best([o for o in outcomes if not o.split])
    best_split = best([o for o in outcomes if o.split])
    peer_goodput = peer.goodput if peer else 0.0
    return {
        "engines": engines,
        "systems": [{"name": o.name, "kind": o.kind, "shape": o.shape, "goodput_rps": o.sweep.goodput,
                     "over_best_peer": ratio(o.goodput, peer_goodput),
                     "probes": [{"rate": rate, "attainment": value, "stopped_early": rate in o.sweep.stopped_early}
                                for rate, value in sorted(o.sweep.probes.items())]}
                    for o in outcomes],
        "chosen_shape": chosen.name if chosen else None,
        "chosen_goodput_rps": chosen.goodput if chosen else None,
        "best_peer": peer.name if peer else None,
        "best_peer_goodput_rps": peer_goodput,
        "chosen_over_best_peer": ratio(chosen.goodput, peer_goodput) if chosen else None,
        "best_split": best_split.name if best_split else None,
        "best_split_goodput_rps": best_split.goodput if best_split else None,
        "best_aggregated": aggregated.name if aggregated else None,
        "best_aggregated_goodput_rps": aggregated.goodput if aggregated else None,
        "split_pays": bool(best_split and aggregated and best_split.goodput > aggregated.goodput),
    }


def first_split_win(reports: list[dict]) -> int | None:
    """The smallest engine count whose report says a split shape beats every aggregated system."""
    paying = [report["engines"] for report in reports if report["split_pays"]]
    return min(paying) if paying else None


def verdict(report: dict) -> str:
    """One line: kvroute's chosen shape against the best peer, a peer named where it wins."""
    chosen, peer = report["chosen_shape"], report["best_peer"]
    ours, theirs = report["chosen_goodput_rps"] or 0.0, report["best_peer_goodput_rps"]
    over = report["chosen_over_best_peer"]
    head = f"{report['engines']} engines: kvroute {chosen} {ours:.3g} req/s, best peer {peer} {theirs:.3g} req/s"
    if over is None:
        return f"{head}: the peer met the bar at no rate"
    return f"{head}: {over:.2f}x" + (f" ({peer} wins)" if over < 1 else "")


def crossover_line(reports: list[dict]) -> str:
    engines = first_split_win(reports)
    counts = ", ".join(str(r["engines"]) for r in reports)
    if engines is None:
        return f"splitting prefill from decode paid at none of {counts} engines: an aggregated system won each"
    report = next(r for r in reports if r["engines"] == engines)
    return (f"splitting prefill from decode first pays at {engines} engines (of {counts}): {report['best_split']} "
            f"{report['best_split_goodput_rps']:.3g} req/s over {report['best_aggregated']} "
            f"{report['best_aggregated_goodput_rps']:.3g} req/s")
