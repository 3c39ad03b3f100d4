"""``kvroute bench replay``: placement policies side by side on a running cluster.

    check     the server answers, serves a model, and accepts every policy in the
              X-KVRoute-Policy header (it needs --allow-policy-override)
    per policy, in the order given:
      reset   empty every cache (POST /admin/reset-cache) so each policy starts cold; a
              server that refuses is said so, on the terminal and in results.json
      replay  the same requests, open loop on their schedule (``replay.replay``)
    write     DIR/results.json, DIR/ttft_cdf.png, DIR/worker_load_over_time.png,
              DIR/hit_rate_over_time.png, and a table on the terminal

The requests come from a named workload generator (``replay_sources.WORKLOADS``) or from
a Mooncake JSONL trace, scaled as ``workloads.trace`` documents.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from rich.console import Console

from foundation import config
from foundation.config import setting
from kvroute.bench.progress import closing_report, request_bar
from kvroute.bench.replay import REQUEST_TIMEOUT_S, ReplayItem, ReplayTarget, Row, replay
from kvroute.bench.replay_report import ms, summary_table
from kvroute.bench.replay_results import ratios, row_dict, summarize
from kvroute.bench.replay_server import ReplayError, ReplayServer
from kvroute.bench.replay_sources import WORKLOADS, WorkloadChoice, trace_items, workload_items
from workloads import parse_options, workload_config
from workloads.trace import TraceFormatError, TraceScaling


@dataclass(frozen=True)
class ReplaySettings:
    url: str = setting("", "the cluster's OpenAI API, e.g. http://127.0.0.1:8000 (required)")
    workload: str = setting("", f"a workload generator: {', '.join(WORKLOADS)}")
    trace: str = setting("", "a Mooncake JSONL trace; its token-id prompts go to /v1/completions")
    policies: tuple[str, ...] = setting(("cache_aware", "round_robin"),
                                        "comma-separated placement policies, run in this order (kvroute's: "
                                        "cache_aware, round_robin, least_loaded, prefix_affinity, block_cost)")
    output: str = setting("results/bench_replay", "folder for results.json and the plots")
    requests: int | None = setting(None, "requests per policy (workload: default the generator's; trace: "
                                         "the first N records, default all)")
    rate: float | None = setting(None, "workload arrival rate in requests/s (default: the generator's)")
    workload_options: tuple[str, ...] = setting((), "comma-separated KEY=VALUE overrides of the workload "
                                                    "generator's config, e.g. groups=8,prompts_per_group=4")
    time_scale: float = setting(1.0, "trace: arrival seconds = timestamp / 1000 x this (2: half the rate)")
    seed: int = setting(0, "seed of the workload, or of the trace's token content")
    api_key: str = setting("", "API key sent as a Bearer token, for servers with keys")
    reset_cache: bool = setting(True, "empty every cache before each policy, where the server allows it")
    request_timeout: float = setting(float(REQUEST_TIMEOUT_S),
                                     "seconds a response may fall silent before the client records a timeout")
    progress: bool = setting(True, "progress bars redrawn in place on a terminal (--no-progress: plain lines)")

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must be an http(s) URL, got {self.url!r}")
        if bool(self.workload) == bool(self.trace):
            raise ValueError("give exactly one of --workload NAME or --trace FILE")
        if self.workload and self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {', '.join(WORKLOADS)}")
        if not self.policies:
            raise ValueError("--policies needs at least one policy")
        if self.requests is not None and self.requests < 1:
            raise ValueError("--requests must be at least 1")
        if self.workload_options and not self.workload:
            raise ValueError("--workload-options needs --workload")
        if self.workload:
            workload_config(self.workload, parse_options(self.workload_options))  # a bad option fails here, not mid-run


def add_cli(bench_commands) -> None:
    parser = bench_commands.add_parser(
        "replay", help="placement policies side by side on a running cluster",
        description=f"Replay a workload ({', '.join(WORKLOADS)}) or a Mooncake trace against a running "
                    "cluster once per policy; writes results.json and PNG plots.")
    config.add_arguments(parser, ReplaySettings)
    parser.set_defaults(func=lambda args: run(config.load(ReplaySettings, args)))


def run(settings: ReplaySettings) -> int:
    console = Console()
    if not console.is_terminal:  # a log file: wide enough for the table instead of 80 columns
        console.width = 160
    server = ReplayServer(settings.url, settings.api_key)
    try:
        with closing_report(settings.output, settings.progress, console):
            return _run(settings, server, console)
    except ReplayError as error:
        console.print(f"[red]kvroute bench replay: {error}[/]", highlight=False)
        return 2
    finally:
        server.close()


def load_items(settings: ReplaySettings) -> tuple[list[ReplayItem], dict]:
    """The requests to replay, and a description of where they came from for results.json."""
    if settings.workload:
        choice = WorkloadChoice(settings.requests, settings.rate, settings.seed, settings.workload_options)
        return workload_items(settings.workload, choice), {"workload": settings.workload, **asdict(choice)}
    scaling = TraceScaling(time_scale=settings.time_scale, seed=settings.seed)
    try:
        items, scaled = trace_items(settings.trace, scaling, settings.requests)
    except (OSError, TraceFormatError) as error:
        raise ReplayError(f"cannot read the trace {settings.trace}: {error}") from None
    if not items:
        raise ReplayError(f"no request of {settings.trace} fits the context after scaling")
    return items, {"trace": settings.trace, "scaling": asdict(scaling), "kept": scaled.kept, "dropped": scaled.dropped}


def worker_labels(server: ReplayServer) -> dict[str, str]:
    """Worker id → "prefill-0" style, in id order per role; empty if the server hides its workers."""
    try:
        workers = server.workers()
    except (ReplayError, httpx.HTTPError, KeyError, ValueError):  # labels are cosmetic; never fail a replay for them
        return {}
    return {wid: f"{role}-{k}" for role in ("prefill", "decode")
            for k, wid in enumerate(sorted(w["worker_id"] for w in workers if w["role"] == role))}


def _run(settings: ReplaySettings, server: ReplayServer, console: Console) -> int:
    items, source = load_items(settings)
    model = server.model_name()
    server.check_policies(model, list(settings.policies))
    labels = worker_labels(server)
    target = server.target(model, settings.request_timeout)
    console.print(f"{len(items)} requests per policy from {settings.workload or settings.trace}, "
                  f"model {model}, workers: {', '.join(labels.values()) or 'unknown'}", highlight=False)
    rows_by_policy, summaries, aborted = _replay_policies(settings, server, target, items, labels, console)
    output = Path(settings.output)
    output.mkdir(parents=True, exist_ok=True)
    _write_results(output / "results.json", settings, source, model, labels, rows_by_policy, summaries, aborted)
    if summaries:
        console.print(summary_table(summaries, list(labels.values()), f"bench replay, {len(items)} requests"))
        _plot(output, rows_by_policy, labels)
    return 1 if aborted else 0


def _replay_policies(settings, server, target, items, labels, console):
    rows_by_policy: dict[str, list[Row]] = {}
    summaries: dict[str, dict] = {}
    warn = lambda message: console.print(f"[yellow]  {message}[/]", highlight=False)  # noqa: E731
    try:
        for policy in settings.policies:
            reset = server.reset_cache(target.model, warn) if settings.reset_cache else {"reset": False}
            rows, duration = replay_with_progress(target, policy, items, console)
            rows_by_policy[policy] = rows
            summaries[policy] = {**summarize(policy, rows, duration, labels), "cache_reset": reset}
            s = summaries[policy]
            console.print(f"  {policy}: {s['succeeded']}/{s['requests']} ok, hit rate {s['hit_rate'] or 0:.1%}, "
                          f"TTFT p50 {ms(s['ttft_p50_s'])} ms p99 {ms(s['ttft_p99_s'])} ms", highlight=False)
    except KeyboardInterrupt:
        console.print("[red]interrupted; writing what was measured[/]")
        return rows_by_policy, summaries, "interrupted"
    return rows_by_policy, summaries, None


def replay_with_progress(target: ReplayTarget, policy: str, items: list[ReplayItem],
                         console: Console) -> tuple[list[Row], float]:
    """``replay.replay`` with a bar of its finished requests and errors on ``console``."""
    with request_bar(console, policy, len(items)) as bar:
        return asyncio.run(replay(target, policy, items, lambda row: bar.advance(failed=not row.succeeded)))


def _write_results(path: Path, settings: ReplaySettings, source: dict, model: str, labels: dict[str, str],
                   rows_by_policy: dict[str, list[Row]], summaries: dict[str, dict], aborted: str | None) -> None:
    result = {
        "settings": asdict(settings) | {"api_key": "***" if settings.api_key else ""},
        "source": source, "model": model, "workers": labels, "aborted": aborted, "written_at": time.time(),
        "caches_reset_between_policies": all(s["cache_reset"].get("reset") for s in summaries.values()),
        "summaries": summaries,
        "ratios": ratios(summaries),
        "requests": [row_dict(row) for rows in rows_by_policy.values() for row in rows],
    }
    path.write_text(json.dumps(result, indent=1))


def _plot(output: Path, rows_by_policy: dict[str, list[Row]], labels: dict[str, str]) -> None:
    from kvroute.bench import replay_plots  # matplotlib: ~1 s that other kvroute commands should not pay

    replay_plots.ttft_cdf(rows_by_policy, output / "ttft_cdf.png")
    replay_plots.worker_load_over_time(rows_by_policy, labels, output / "worker_load_over_time.png")
    replay_plots.hit_rate_over_time(rows_by_policy, output / "hit_rate_over_time.png")
