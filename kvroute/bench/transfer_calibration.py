"""Link estimates (bandwidth, latency) from a transfer benchmark's measured transfers.

The planner's ``LinkCalibrator`` follows real transfers per (source, destination); this
feeds it the benchmark's, so ``results.json`` turns into the ``LinkEstimate`` values a
cost model is started with::

    calibrator = LinkCalibrator()
    observe_results(calibrator, json.loads(path.read_text()))
    model = dataclasses.replace(CostModel(), links=calibrator.estimates())

or, without replaying, ``load_link_estimates(results)`` for the estimates the benchmark
itself reported. A benchmark link is named ``<link>/<backend>/sender`` →
``<link>/<backend>/receiver``; map those names onto worker ids to use them for a fleet.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvroute.bench.transfer_sweep import KVBytes, comparison_row
from orchestrator.planner.calibration import LinkCalibrator
from orchestrator.planner.cost_model import LinkEstimate, transfer_seconds


def link_key(link: str, backend: str) -> tuple[str, str]:
    return f"{link}/{backend}/sender", f"{link}/{backend}/receiver"


def transfer_observations(link: str, pair_rows: Iterable[Mapping]) -> list[tuple[str, str, int, float]]:
    """(source, destination, bytes, seconds) of every timed backend transfer of one link.

    The calibrator weighs recent transfers most, so the sizes are interleaved (the i-th
    repetition of every size, then the next) as a mixed workload would deliver them;
    in measurement order the last size alone would dominate and hide the latency."""
    by_backend: dict[str, list[Mapping]] = {}
    for row in pair_rows:
        by_backend.setdefault(row["backend"], []).append(row)
    observations = []
    for backend, rows in sorted(by_backend.items()):
        source, destination = link_key(link, backend)
        reps = max(len(row["samples_seconds"]["backend"]) for row in rows)
        for rep in range(reps):
            for row in rows:
                samples = row["samples_seconds"]["backend"]
                if rep < len(samples):
                    observations.append((source, destination, row["bytes"], samples[rep]))
    return observations


def observe_results(calibrator: LinkCalibrator, results: Mapping) -> LinkCalibrator:
    """Replay every transfer of a ``kvroute bench transfer`` results document."""
    for link in results["links"]:
        for source, destination, num_bytes, seconds in transfer_observations(link["name"], link["pair_rows"]):
            calibrator.observe(source, destination, num_bytes, seconds)
    return calibrator


def estimates_report(calibrator: LinkCalibrator) -> list[dict]:
    """The calibrator's estimates as JSON rows (what ``results.json`` stores)."""
    return [{"source": source, "destination": destination,
             "bandwidth_bytes_per_second": estimate.bandwidth_bytes_per_second,
             "latency_seconds": estimate.latency_seconds}
            for (source, destination), estimate in calibrator.estimates().items()]


def load_link_estimates(results: Mapping) -> dict[tuple[str, str], LinkEstimate]:
    """The estimates a results document reports, keyed as ``CostModel.links`` is."""
    return {(row["source"], row["destination"]):
            LinkEstimate(row["bandwidth_bytes_per_second"], row["latency_seconds"])
            for row in results["link_estimates"]}


def predicted_rows(link: str, backend: str, kv: KVBytes, lengths: Iterable[int], estimate: LinkEstimate,
                   recompute_seconds: Mapping[int, float]) -> list[dict]:
    """Rows for lengths a link did not run (a slow link skips the long ones), with the
    transfer time the cost model would predict from the link's estimate."""
    return [comparison_row(link, backend, tokens, kv.prompt_bytes(tokens),
                           transfer_seconds(kv.prompt_bytes(tokens), estimate), recompute_seconds.get(tokens),
                           measured=False)
            for tokens in lengths]
