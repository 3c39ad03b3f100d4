"""The results page's real-cluster sections: a repository-assistant run and a trace run,
each with its targets and the simulator's validation table on the same requests."""

from __future__ import annotations

from kvroute.bench.results_page.runs import REPOSITORY, real_targets, target_ratios
from kvroute.bench.results_page.text import cell, table, verdict


def real_section(real: dict) -> str:
    summaries = table(["policy", "P50 TTFT (s)", "P99 TTFT (s)", "2nd token P99 (s)", "hit rate", "errors"],
                      [[policy, cell(s["ttft_p50_s"]), cell(s["ttft_p99_s"]), cell(s.get("second_token_p99_s")),
                        cell(s["hit_rate"], "%"), s.get("errors", 0)]
                       for policy, s in real["summaries"].items()])
    # Pages made before the real section judged its targets: judged here from its ratios.
    targets = targets_table(real.get("targets") or real_targets(REPOSITORY, real["summaries"], real["ratios"]))
    config, ratio = real["workload"], real["ratios"]
    source = f", `kvroute bench placement` (`{real['source']}`)" if real.get("source") else ""
    out = (f"## The real cluster\n\n{len(real['workers'])} vLLM-CPU workers ({', '.join(real['workers'].values())}"
           f"){source}, {config['requests']} requests at {config['rate']} requests/s over {config['repositories']} "
           f"repositories: {ratio_sentence(ratio)}" + recorded(real) + f"\n\n{summaries}\n\n{targets}")
    return out + validation_table(real)


def targets_table(judged: list[dict]) -> str:
    return table(["target", "real cluster"], [[t["target"], verdict(t)] for t in judged])


def ratio_sentence(found: dict) -> str:
    ratio = target_ratios(found)
    return (f"cache_aware/round_robin P50 {cell(ratio['p50_ratio'])}, cache_aware/{ratio['best_baseline_p99']} "
            f"(best baseline) P99 {cell(ratio['p99_ratio'])}.")


def recorded(real: dict) -> str:
    return (f" As recorded by `{real['recorded_by']}`, with its validation table (the simulator as it was then)."
            if real.get("recorded_by") else "")


def real_trace_section(real: dict) -> str:
    trace, ratio = real["trace"], real["ratios"]
    scaling, bounds = trace["scaling"], trace["bounds"]
    summaries = table(["policy", "P50 TTFT (s)", "P99 TTFT (s)", "hit rate", "reused tokens", "of LRU",
                       "of unlimited", "errors"],
                      [[policy, cell(s["ttft_p50_s"]), cell(s["ttft_p99_s"]), cell(s["hit_rate"], "%"),
                        f"{s['cached_tokens']:,}", cell(s.get("of_lru_all_workers"), "%"),
                        cell(s.get("of_unlimited"), "%"), s.get("errors", 0)]
                       for policy, s in real["summaries"].items()])
    targets = targets_table(real["targets"])
    out = (f"## The real cluster: trace\n\n{len(real['workers'])} vLLM-CPU workers "
           f"({', '.join(real['workers'].values())}), `kvroute bench trace` (`{real['source']}`): every record of "
           f"{trace['family_fraction']:.0%} of the trace's prefix families ({trace['kept']} requests, "
           f"{trace['dropped']} dropped), 512-token blocks as {scaling['block_tokens']} tokens, outputs "
           f"x{scaling['output_scale']:g}, time x{scaling['time_scale']:g}; {trace['kv_cache_blocks_per_worker']} "
           f"blocks of {bounds['block_size']} tokens per worker. Reuse bounds of these requests: unlimited "
           f"{bounds['unlimited']['reused_tokens']:,}, one shared LRU of all workers' blocks "
           f"{bounds['lru_all_workers']['reused_tokens']:,} of {bounds['prompt_tokens']:,} prompt tokens. "
           f"{ratio_sentence(ratio)}" + recorded(real) + f"\n\n{summaries}\n\n{targets}")
    return out + validation_table(real)


def validation_table(real: dict) -> str:
    if "comparison" not in real:
        return f"\n\nNo validation table: {real.get('validation_error')}."
    rows = [[policy, cell(r["real_p50_s"]), cell(r["sim_p50_s"]), cell(r["p50_ratio"], "x"),
             "pass" if r["within_band"] else "FAIL", "{1:.2f} ({0:.2f}-{2:.2f})".format(*r["jittered_p50_ratio"]),
             cell(r["real_p99_s"]), cell(r["sim_p99_s"]), cell(r["real_hit_rate"], "%"), cell(r["sim_hit_rate"], "%")]
            for policy, r in real["comparison"].items()]
    return (f"\n\nThe simulator on the same requests and cluster (`kvroute bench validate-simulator`'s model: "
            f"shared cores, per-step load reports, held blocks; jittered over {real['seeds']} seeds):\n\n"
            + table(["policy", "real P50", "sim P50", "sim/real", f"within ±{real['band']:.0%}",
                     "jittered sim/real, median (5-95%)", "real P99", "sim P99", "real hit", "sim hit"], rows))
