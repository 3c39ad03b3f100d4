"""Builds ``kvroute.json``, the Grafana dashboard of a kvroute orchestrator, with grafanalib.

    python deploy/grafana/build.py           # (re)write kvroute.json beside this file
    python deploy/grafana/build.py --check   # exit 1 when kvroute.json is not what this builds

The panels are data (``SECTIONS``): a title, a unit, what it shows, and its PromQL over the
series of ``orchestrator/metrics.py``. Every query works without the recording rules of
``deploy/prometheus/kvroute-rules.yml``, so the dashboard stands on its own. ``$datasource``
picks the Prometheus that scrapes the orchestrators; ``$__rate_interval`` is Grafana's.
tests/integration/test_grafana_prometheus.py runs every query against a real Prometheus.
"""

from __future__ import annotations

import argparse
import io
import sys
from dataclasses import dataclass
from pathlib import Path

from grafanalib._gen import write_dashboard
from grafanalib.core import Dashboard, GridPos, RowPanel, Target, Template, Templating, Time, TimeSeries

OUTPUT = Path(__file__).with_name("kvroute.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "[$__rate_interval]"
PANEL_WIDTH, PANEL_HEIGHT = 12, 8  # two panels a row on Grafana's 24-column grid


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    description: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)


def quantiles(histogram: str, by: str = "", levels: tuple[float, ...] = (0.5, 0.9, 0.99)) -> tuple:
    """``histogram``'s quantiles over the rate window, one query per level, split ``by`` labels."""
    labels = f"le, {by}" if by else "le"
    legend_by = "".join(f" {{{{{label.strip()}}}}}" for label in by.split(",") if label.strip())
    return tuple((f"histogram_quantile({level}, sum by ({labels}) (rate({histogram}_bucket{RATE})))",
                  f"p{level * 100:g}{legend_by}") for level in levels)


def per_second(counter: str, by: str, legend: str) -> tuple[str, str]:
    return f"sum by ({by}) (rate({counter}_total{RATE}))", legend


SECTIONS: dict[str, tuple[Panel, ...]] = {
    "Traffic": (
        Panel("Request rate", "reqps", "HTTP requests per second by endpoint and status.",
              (per_second("kvroute_requests", "endpoint, status", "{{endpoint}} {{status}}"),)),
        Panel("429s", "reqps", "Requests refused with 429: over a tenant's rate limit, and with no feasible "
                               "plan (every worker at its concurrency cap for --admission-wait).",
              (per_second("kvroute_rate_limited", "tenant", "rate limited {{tenant}}"),
               (f"sum(rate(kvroute_requests_rejected_total{RATE}))", "no feasible plan"))),
    ),
    "Latency": (
        Panel("Time to first token", "s", "Request arrival to first token, as the client sees it.",
              quantiles("kvroute_time_to_first_token_seconds")),
        Panel("Time per output token", "s", "Mean gap between the tokens after the second, per request.",
              quantiles("kvroute_inter_token_latency_seconds")),
        Panel("Hand-off (time to second token)", "s", "First to second token: the prefill→decode hand-off.",
              quantiles("kvroute_time_to_second_token_seconds", by="plan", levels=(0.5, 0.99))),
        Panel("End to end", "s", "Request arrival to last token.",
              quantiles("kvroute_e2e_request_latency_seconds")),
    ),
    "Cache": (
        Panel("Hit rate per worker", "percentunit",
              "Share of the prompt tokens placed on a worker that its engine found in its prefix cache.",
              ((f"sum by (worker) (rate(kvroute_cached_prompt_tokens_total{RATE})) / "
                f"sum by (worker) (rate(kvroute_prompt_tokens_total{RATE}))", "{{worker}}"),)),
        Panel("Reused tokens per worker", "short", "Prompt tokens per second the prefilling engine found cached.",
              (per_second("kvroute_cached_prompt_tokens", "worker", "{{worker}}"),)),
    ),
    "Placement": (
        Panel("Plan kinds", "reqps", "Placements per second by policy and plan kind (local, disagg, pull).",
              (per_second("kvroute_plans", "policy, plan", "{{policy}} {{plan}}"),)),
        Panel("Estimate vs actual", "short",
              "Actual TTFT over the chosen plan's estimate (1 is exact; above 1 the planner was optimistic), "
              "and the prompt tokens it expected to reuse against those reused.",
              quantiles("kvroute_ttft_estimate_ratio", by="policy", levels=(0.5, 0.9))
              + (per_second("kvroute_estimated_reused_tokens", "worker", "expected reuse {{worker}}"),
                 per_second("kvroute_cached_prompt_tokens", "worker", "reused {{worker}}"),
                 per_second("kvroute_index_mispredictions", "worker", "index mispredictions {{worker}}"))),
        Panel("Queue depth", "short",
              "Requests waiting in each worker's engine and prompt tokens still to compute there (from its "
              "heartbeats), and requests the orchestrator holds until a worker is under its cap.",
              (("sum by (worker) (kvroute_worker_requests_waiting)", "waiting {{worker}}"),
               ("sum by (worker) (kvroute_worker_queued_prefill_tokens)", "queued prompt tokens {{worker}}"),
               ("sum(kvroute_requests_awaiting_capacity)", "awaiting capacity"),
               ("sum(kvroute_requests_in_flight)", "in flight"))),
    ),
    "Transfers": (
        Panel("Transfer bytes per link", "Bps", "KV bytes per second pulled over each link.",
              (per_second("kvroute_transfer_bytes", "source, destination", "{{source}} → {{destination}}"),)),
        Panel("Transfer seconds per link", "s", "Time of one KV pull over each link.",
              quantiles("kvroute_transfer_seconds", by="source, destination", levels=(0.5, 0.99))),
    ),
    "Workers": (
        Panel("Worker health", "short",
              "Live workers by role, and each worker's circuit breaker: 0 closed, 1 half-open, 2 open "
              "(out of rotation).",
              (("sum by (role) (kvroute_workers)", "live {{role}}"),
               ("max by (worker) (kvroute_worker_breaker_state)", "breaker {{worker}}"),
               per_second("kvroute_worker_failures", "role", "failures {{role}}"))),
        Panel("Draining", "short", "Workers finishing their requests before they stop, by role "
                                   "(not counted as live).",
              (("sum by (role) (kvroute_workers_draining)", "draining {{role}}"),)),
    ),
}


def timeseries(panel: Panel, position: GridPos) -> TimeSeries:
    targets = [Target(expr=expr, legendFormat=legend, refId=chr(ord("A") + i), datasource=DATASOURCE)
               for i, (expr, legend) in enumerate(panel.queries)]
    return TimeSeries(title=panel.title, description=panel.description, unit=panel.unit, dataSource=DATASOURCE,
                      targets=targets, gridPos=position)


def laid_out() -> list:
    """Each section a row, its panels two a row below it."""
    panels, y = [], 0
    for section, members in SECTIONS.items():
        panels.append(RowPanel(title=section, gridPos=GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        for i, panel in enumerate(members):
            panels.append(timeseries(panel, GridPos(h=PANEL_HEIGHT, w=PANEL_WIDTH, x=(i % 2) * PANEL_WIDTH,
                                                    y=y + (i // 2) * PANEL_HEIGHT)))
        y += -(-len(members) // 2) * PANEL_HEIGHT
    return panels


def dashboard() -> Dashboard:
    datasource = Template(name="datasource", label="Data source", type="datasource", query="prometheus",
                          default="Prometheus")
    return Dashboard(title="kvroute", uid="kvroute", tags=["kvroute", "llm-serving"],
                     description="A kvroute orchestrator: traffic, latency, cache reuse, placement, KV "
                                 "transfers and worker health (orchestrator/metrics.py).",
                     time=Time("now-1h", "now"), refresh="30s", templating=Templating([datasource]),
                     panels=laid_out()).auto_panel_ids()


def rendered() -> str:
    out = io.StringIO()
    write_dashboard(dashboard(), out)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with kvroute.json instead of writing it")
    args = parser.parse_args(argv)
    text = rendered()
    if not args.check:
        OUTPUT.write_text(text)
        return 0
    if OUTPUT.exists() and OUTPUT.read_text() == text:
        return 0
    print(f"{OUTPUT} is not what {Path(__file__).name} builds: run python {__file__}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
