"""The side-by-side phase of ``kvroute bench disagg``: the same kind of disaggregated request
over several transfer paths, each served by a prefill/decode worker pair of its own, started
alike (same CPUs, model, dtype, KV budget). Requests alternate between the paths, and the
order turns each repetition, so drift and other load weigh on every path alike.

A path is what the two workers of a pair were started with (``PATHS``):

* ``default``: no transfer flags, today's default: on one host the decode worker reads the
  producer's staged copy from shared memory;
* ``nixl``: ``--transfer-link nixl`` on both: the decode worker READs the staged lease from
  the producer's staging arena straight into its paged cache (``transfer.direct_reads``);
* ``auto``: ``--transfer-link auto`` on both: a link per pair, its backend chosen by
  measurement at its set-up; where that is nixl, direct READs as on the ``nixl`` path, else
  the link's frames scattered into the cache.

Each path's first request is a warm-up, reported apart: it pays one-off costs, among them
a link's set-up (and ``auto``'s probe). For each prompt length the result gives, per path,
TTFT, the hand-off gap (first to second token) and their sum, each request's own, with the
ratio of the sum's median to the baseline path's (``compare``).
"""

from __future__ import annotations

from kvroute.bench.disagg.context import STATS_TIMEOUT, console, summary
from kvroute.bench.disagg.handoff import disaggregated_request

# Worker flags of each path, on both workers of its pair.
PATHS: dict[str, tuple[str, ...]] = {
    "default": (),
    "nixl": ("--transfer-link", "nixl"),
    "auto": ("--transfer-link", "auto"),
}
BASELINE = "default"
# What each path's decode worker counts of how its pulls went (foundation.wire.TransferCounters).
PULL_COUNTERS = ("pulls_ok", "pulls_failed", "shared_pulls", "direct_pulls", "links_opened", "links_measured")


def request_order(paths: list[str], repetition: int) -> list[str]:
    """The paths in the order repetition ``repetition`` visits them: turned by one each time."""
    turn = repetition % len(paths)
    return paths[turn:] + paths[:turn]


def compare(runs: dict[str, list[dict]], baseline: str = BASELINE) -> dict:
    """Per path, summaries of TTFT, hand-off gap and their sum over ``runs`` (results of
    ``handoff.disaggregated_request``), and the ratio of each median to the baseline's."""
    paths = {}
    for path, samples in runs.items():
        sums = [_sum(run["ttft_s"], run["handoff_gap_s"]) for run in samples]
        paths[path] = {"ttft_s": summary([run["ttft_s"] for run in samples]),
                       "handoff_gap_s": summary([run["handoff_gap_s"] for run in samples]),
                       "ttft_plus_gap_s": summary(sums),
                       "decode_pull_seconds": summary([run["decode_pull_seconds"] for run in samples]),
                       "all_pulled": all(run["decode_pulls_ok"] == 1 and run["decode_pulls_failed"] == 0
                                         for run in samples),
                       "runs": samples}
    base = paths.get(baseline)
    for entry in paths.values():
        entry["ratio_vs_baseline"] = {key: _ratio(entry[key]["median"], base[key]["median"] if base else None)
                                      for key in ("ttft_s", "handoff_gap_s", "ttft_plus_gap_s")}
    return paths


def pool_starts(starts: list[dict]) -> dict:
    """The phase over several starts of every pair (``--pair-starts``): each length's requests of
    all starts compared together, the pull counters summed, warm-ups and each start's TTFT + gap
    ratios kept per start. Why: two pairs' prefill workers, started alike, compute the same prompt
    a per-process constant apart (up to 18% at ~1024 tokens here, of either sign from one start to
    the next), which a single start charges to the path; fresh processes at every start spread it
    over every path."""
    if len(starts) == 1:
        return starts[0]
    first = starts[0]
    lengths = {length: compare({path: [run for start in starts for run in start["lengths"][length][path]["runs"]]
                                for path in per_path}, baseline=first["baseline"])
               for length, per_path in first["lengths"].items()}
    counters: dict[str, dict] = {}
    for start in starts:
        for path, named in start["decode_counters"].items():
            merged = counters.setdefault(path, {})
            for name, value in named.items():
                merged[name] = merged.get(name, [] if isinstance(value, list) else 0) + value
    by_start = [{length: {path: entry["ratio_vs_baseline"]["ttft_plus_gap_s"] for path, entry in per_path.items()}
                 for length, per_path in start["lengths"].items()} for start in starts]
    return {"baseline": first["baseline"], "starts": len(starts), "warm_up": [start["warm_up"] for start in starts],
            "lengths": lengths, "decode_counters": counters, "ttft_plus_gap_ratio_by_start": by_start}


async def measure_paths(contexts: dict) -> dict:
    """``contexts``: a ``context.Context`` per path, the baseline first."""
    console.rule("Paths side by side: " + ", ".join(contexts))
    any_context = next(iter(contexts.values()))
    args, prompts = any_context.args, any_context.prompts
    paths = list(contexts)
    warm_up = {}
    for path in paths:  # one-off costs: the first pull between the pair, a link's set-up
        warm_up[path] = await disaggregated_request(contexts[path], prompts.chat(min(args.ttft_lengths)))
        console.log(f"{path}: warm-up hand-off {_seconds(warm_up[path]['handoff_gap_s'])}")
    results = {"baseline": paths[0], "warm_up": warm_up, "lengths": {}}
    for length in args.ttft_lengths:
        runs: dict[str, list[dict]] = {path: [] for path in paths}
        for repetition in range(args.ttft_reps):
            for path in request_order(paths, repetition):
                runs[path].append(await disaggregated_request(contexts[path], prompts.chat(length)))
            console.log(f"~{length} tokens rep {repetition + 1}: " + "; ".join(
                f"{path} TTFT {_seconds(runs[path][-1]['ttft_s'])} + gap {_seconds(runs[path][-1]['handoff_gap_s'])}"
                for path in paths))
        results["lengths"][str(length)] = compare(runs, baseline=paths[0])
    results["decode_counters"] = {path: await _pull_counters(contexts[path]) for path in paths}
    return results


async def _pull_counters(context) -> dict:
    """How the path's decode worker pulled: counters, and the link choices it measured."""
    transfer = (await context.decode.stats(STATS_TIMEOUT)).transfer
    counters = {name: getattr(transfer, name) for name in PULL_COUNTERS}
    counters["link_measurements"] = [{"chosen": m.chosen, "candidates": m.candidates, "seconds": m.seconds,
                                      "probe_bytes": m.probe_bytes, "set_up_seconds": m.set_up_seconds}
                                     for m in transfer.link_measurements]
    return counters


def _sum(ttft: float | None, gap: float | None) -> float | None:
    return ttft + gap if ttft is not None and gap is not None else None


def _ratio(value: float | None, baseline: float | None) -> float | None:
    return value / baseline if value is not None and baseline else None


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f} s"
