"""results.json of a peers sweep: what ran under which rules, every run's metrics, goodput, winners.

Shape (``document``)::

    settings, resources, targets, router {package, version}, client, sources, aborted
    systems:     [{system, description, settings, skipped, start_s}]   skipped: the reason, or null
    runs:        [{system, workload, rate, repeats, cache_reset, <report.run_metrics>}]
    goodput:     {workload: {system: req/s or null}}
    comparisons: {workload: {goodput: <report.compare>, rates: {rate: {metric: <report.compare>}}}}
    requests:    one row per request (replay_results.row_dict) with system, workload and rate
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from kvroute.bench.peers import report
from kvroute.bench.peers.router_env import ROUTER_PACKAGE, ROUTER_VERSION
from kvroute.bench.peers.run import Sweep
from kvroute.bench.replay_results import row_dict

CLIENT = ("kvroute.bench.replay: open-loop streaming OpenAI requests, TTFT/TPOT/E2E from the chunks' arrival, "
          "prompt and cached tokens from the usage chunk")


def document(sweep: Sweep, settings: dict, resources: dict, targets: report.Targets, comparisons: dict,
             include_requests: bool = True) -> dict:
    return {
        "settings": settings, "resources": resources, "targets": asdict(targets),
        "router": {"package": ROUTER_PACKAGE, "version": ROUTER_VERSION}, "client": CLIENT,
        "sources": sweep.sources, "aborted": sweep.aborted, "written_at": time.time(),
        "systems": [{"system": r.system, "description": r.description, "settings": r.settings,
                     "skipped": r.skipped, "start_s": r.start_s} for r in sweep.systems],
        "runs": [{"system": run.system, "workload": run.workload, "rate": run.rate, "repeats": run.repeats,
                  "cache_reset": run.cache_reset,
                  **run.metrics} for record in sweep.systems for run in record.runs],
        "goodput": {workload: c["goodput"]["values"] for workload, c in comparisons.items()},
        "comparisons": comparisons,
        "requests": [{"system": run.system, "workload": run.workload, "rate": run.rate, **row_dict(row)}
                     for record in sweep.systems for run in record.runs for row in run.rows]
        if include_requests else [],
    }


def write(path: Path, doc: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str))
    return path
