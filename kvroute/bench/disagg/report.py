"""The verdict and the tables of ``kvroute bench disagg``."""

from __future__ import annotations

from rich.table import Table

from kvroute.bench.disagg.context import TARGET_MIN_BYTES, TARGET_RATIO, MiB, console, fmt

# The connector's two paths: a consumer on the producer's host reads the shared copy; one
# on another host gets frames.
CONNECTOR_PATHS = {"shared_copy": "ratio_connector_shared_vs_raw", "frames": "ratio_connector_vs_raw"}


def verdict(transfer: dict) -> dict:
    paths = {}
    for path, ratio_key in CONNECTOR_PATHS.items():
        per_size = {key: {"bytes": entry["bytes"], "ratio": entry[ratio_key], "met": entry[ratio_key] >= TARGET_RATIO}
                    for key, entry in transfer["sizes"].items() if entry["bytes"] >= TARGET_MIN_BYTES}
        paths[path] = {"per_size": per_size, "met": bool(per_size) and all(v["met"] for v in per_size.values())}
    return {"target_ratio": TARGET_RATIO, "applies_from_bytes": TARGET_MIN_BYTES,
            "definition": "median raw pyzmq time / median connector pull time into a paged cache: from the "
                          "producer's shared copy (shared_copy: workers on one host, the default there), or as "
                          "zero-copy frames scattered into the cache on arrival (frames: across hosts)",
            "paths": paths, "met": paths["shared_copy"]["met"]}


# ---------------------------------------------------------------- output


def print_tables(results: dict) -> None:
    """A table for each phase that ran, then the verdict where the transfer phase ran."""
    for phase, print_phase in (("ttft", _print_ttft), ("transfer", _print_transfer), ("end_to_end", _print_end_to_end),
                               ("paths", _print_paths)):
        if phase in results:
            print_phase(results)
    foreign = results.get("foreign_cpu_cores", {})
    if any(value > 0.1 for value in foreign.values()):
        console.print("[yellow]Other processes loaded this machine during the run (cores used, by phase): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in foreign.items()))
    if "verdict" in results:
        _print_verdict(results["verdict"])


def _print_ttft(results: dict) -> None:
    table = Table(title="TTFT (medians, seconds)")
    for column in ("prompt tokens", "single TTFT", "disagg TTFT", "disagg/single",
                   "hand-off gap (1st→2nd)", "decode ITL (single)", "decode ITL (disagg)", "other procs (cores)"):
        table.add_column(column, justify="right")
    for length, entry in results["ttft"].items():
        single, disagg = entry["single"]["ttft_s"]["median"], entry["disagg"]["ttft_s"]["median"]
        table.add_row(f"~{length} ({fmt(entry['prompt_tokens']['median'], '.0f')})", fmt(single), fmt(disagg),
                      fmt(disagg / single if single else None, ".2f", suffix="x"),
                      fmt(entry["disagg"]["handoff_gap_s"]["median"]),
                      fmt(entry["single"]["decode_itl_s"]["median"], ".4f"),
                      fmt(entry["disagg"]["decode_itl_s"]["median"], ".4f"),
                      fmt(entry["foreign_cpu_cores"]["median"], ".2f"))
    console.print(table)


def _print_transfer(results: dict) -> None:
    table = Table(title="Block transfer (median of runs; GB/s = 1e9 bytes/s)")
    names = ("connector_shared", "connector_scatter", "connector_noop", "raw", "raw_fresh_socket", "raw_scatter",
             "raw_during_lease")
    for column in ("size", "blocks", "connector (shared copy)", "connector (frames)", "frames, no scatter",
                   "raw pyzmq", "raw (fresh socket)", "raw + scatter", "raw, lease held", "shared/raw", "frames/raw",
                   "other procs (cores)"):
        table.add_column(column, justify="right")
    table.caption = ("cells: GB/s (ms). raw: sender pinned like the block server, no lease held; "
                     "raw, lease held: unpinned sender while the producer holds the lease; "
                     "other procs: CPU cores used by other people's processes (raw phase / lease phase)")
    for entry in results["transfer"]["sizes"].values():
        table.add_row(f"{entry['mib']:.1f} MiB", str(entry["blocks"]),
                      *(f"{fmt(entry[n]['median_gbps'], '.2f')} GB/s ({fmt(entry[n]['median'], '.1f', 1000)} ms)"
                        for n in names),
                      *(_ratio_cell(entry, CONNECTOR_PATHS[path]) for path in ("shared_copy", "frames")),
                      f"{entry['foreign_cpu_cores_raw_phase']:.2f} / {entry['foreign_cpu_cores_lease_phase']:.2f}")
    console.print(table)


def _print_end_to_end(results: dict) -> None:
    table = Table(title="End-to-end hand-off (generate_disaggregated, medians)")
    for column in ("size", "prompt tokens", "bytes received", "hand-off gap", "decode ITL",
                   "bytes / gap", "bytes / (gap − ITL)", "all pulled", "other procs (cores)"):
        table.add_column(column, justify="right")
    for key, entry in results["end_to_end"].items():
        table.add_row(f"{key} MiB", str(entry["prompt_tokens"]),
                      fmt(entry["decode_bytes_received"]["median"], ".1f", 1 / MiB, " MiB"),
                      fmt(entry["handoff_gap_s"]["median"], ".3f", suffix=" s"),
                      fmt(entry["decode_itl_s"]["median"], ".4f", suffix=" s"),
                      fmt(entry["handoff_throughput_gbps"], ".2f", suffix=" GB/s"),
                      fmt(entry["handoff_minus_itl_throughput_gbps"], ".2f", suffix=" GB/s"),
                      "yes" if entry["all_pulled"] else "[red]no",
                      fmt(entry["foreign_cpu_cores"]["median"], ".2f"))
    console.print(table)


def _print_paths(results: dict) -> None:
    paths = results["paths"]
    baseline = paths["baseline"]
    table = Table(title=f"Paths side by side (medians; ratio: path / {baseline})")
    for column in ("prompt tokens", "path", "TTFT", "hand-off gap", "TTFT + gap", f"TTFT + gap / {baseline}",
                   "consumer pull", "all pulled"):
        table.add_column(column, justify="right")
    for length, per_path in paths["lengths"].items():
        for path, entry in per_path.items():
            table.add_row(f"~{length}", path, fmt(entry["ttft_s"]["median"]), fmt(entry["handoff_gap_s"]["median"]),
                          fmt(entry["ttft_plus_gap_s"]["median"]),
                          fmt(entry["ratio_vs_baseline"]["ttft_plus_gap_s"], ".2f", suffix="x"),
                          fmt(entry["decode_pull_seconds"]["median"], ".4f"),
                          "yes" if entry["all_pulled"] else "[red]no")
    table.caption = "pulls by path: " + "; ".join(
        f"{path}: " + ", ".join(f"{name} {value}" for name, value in counters.items() if name != "link_measurements")
        for path, counters in paths["decode_counters"].items())
    console.print(table)
    for length in paths["lengths"] if "ttft_plus_gap_ratio_by_start" in paths else ():
        console.print(f"~{length} tokens, TTFT + gap / {baseline} start by start: " + "; ".join(
            ", ".join(f"{path} {fmt(ratio, '.2f', suffix='x')}" for path, ratio in start[length].items()
                      if path != baseline)
            for start in paths["ttft_plus_gap_ratio_by_start"]))


def _print_verdict(v: dict) -> None:
    for path, outcome in v["paths"].items():
        console.print(f"Target connector ({path}) ≥ {v['target_ratio']}x raw pyzmq for transfers ≥ 8 MB: "
                      + ("[green]MET" if outcome["met"] else "[red]NOT MET") + " ("
                      + ", ".join(f"{k} MiB: {s['ratio']:.2f}x" for k, s in outcome["per_size"].items()) + ")")


def _ratio_cell(entry: dict, ratio_key: str) -> str:
    ratio = entry[ratio_key]
    if entry["bytes"] < TARGET_MIN_BYTES:
        return f"{ratio:.2f}x"
    return f"{ratio:.2f}x " + ("[green]met" if ratio >= TARGET_RATIO else "[red]not met")
