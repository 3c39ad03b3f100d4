"""``kvroute probe worker``: a worker's health from its status file, for exec probes.

::

    live    the heartbeat loop wrote the file within --max-age, and the engine is healthy.
            A draining worker is alive, and so is one that no orchestrator has accepted
            (all of them down, say): restarting it would lose its cache and running requests
            and fix nothing.
    ready   alive, not draining, accepted by at least one orchestrator within --max-age,
            and refused by none.

The answer is an exit status (0 or 1) and one line saying why, which kubelet keeps in the
pod's events. A worker still loading its model has written no file yet and is not alive:
a startupProbe running ``live`` covers that phase, so the liveness probe, which starts
after it, never kills a worker that is loading. It imports only the status file's module,
since kubelet starts it every few seconds in every worker's container.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from worker.status_file import StatusFileError, WorkerStatus, read_status

CHECKS = ("live", "ready")


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    reason: str


def judge(status: WorkerStatus, check: str, now: float, max_age: float) -> ProbeResult:
    """Whether ``status`` passes ``check`` (one of ``CHECKS``) at wall-clock ``now``."""
    age = now - status.written_at
    if age > max_age:
        return ProbeResult(False, f"status written {age:.1f} s ago, more than {max_age:g} s: the heartbeat loop "
                                  f"has stopped")
    if not status.engine_healthy:
        return ProbeResult(False, f"engine unhealthy: {status.engine_problem or 'no reason given'}")
    if check == "live":
        return ProbeResult(True, f"alive: heartbeats current, engine healthy{', draining' if status.draining else ''}")
    if status.draining:
        return ProbeResult(False, "draining: finishing its requests, taking no new ones")
    return _registration(status, now, max_age)


def _registration(status: WorkerStatus, now: float, max_age: float) -> ProbeResult:
    known = len(status.orchestrators)
    refusals = [o for o in status.orchestrators if o.accepted is False]
    if refusals:
        return ProbeResult(False, f"refused by {len(refusals)} of {known} orchestrators; {refusals[0].address}: "
                                  f"{refusals[0].reason}")
    accepted = [o for o in status.orchestrators if o.accepted and now - o.last_accepted_at <= max_age]
    if not accepted:
        return ProbeResult(False, f"not registered: none of {known} orchestrators accepted a heartbeat in the "
                                  f"last {max_age:g} s")
    return ProbeResult(True, f"ready: registered with {len(accepted)} of {known} orchestrators")


def probe(path: Path, check: str, max_age: float, now: float | None = None) -> ProbeResult:
    try:
        status = read_status(path)
    except StatusFileError as error:
        return ProbeResult(False, str(error))
    return judge(status, check, time.time() if now is None else now, max_age)


def add_cli(commands) -> None:
    """Register ``probe worker`` on the main CLI's sub-commands."""
    probes = commands.add_parser("probe", help="health checks for exec probes (Kubernetes)")
    kinds = probes.add_subparsers(dest="probe", required=True)
    worker = kinds.add_parser("worker", help="a worker's health from its --status-file: exit 0 or 1 and one line")
    worker.add_argument("--status-file", type=Path, required=True, help="the worker's --status-file")
    worker.add_argument("--max-age", type=float, default=10.0,
                        help="seconds within which the heartbeat loop must have written the file, and (ready) an "
                             "orchestrator accepted a heartbeat (default: %(default)s)")
    worker.add_argument("--check", choices=CHECKS, default="live",
                        help="live: heartbeats current and engine healthy (liveness, startup); ready: also "
                             "registered and not draining (readiness) (default: %(default)s)")
    worker.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.max_age <= 0:
        print("--max-age must be positive")
        return 2
    result = probe(args.status_file, args.check, args.max_age)
    print(result.reason)
    return 0 if result.ok else 1
