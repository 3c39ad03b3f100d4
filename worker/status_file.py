"""The worker's status file: what a probe outside the process reads to judge its health.

A worker speaks only CURVE ZeroMQ, and its RPC answers only the orchestrator's key, so a
kubelet (or any supervisor) cannot ask it directly. Instead the heartbeat loop writes this
small JSON file after every round: whether the engine is healthy, whether the worker is
draining, and what each orchestrator last said. ``written_at`` going stale means the loop
itself stopped. The file is replaced by rename, so a reader never sees half of it.
``kvroute probe worker`` (``worker.probe``) reads it.

Writer: the worker's heartbeat task, through ``StatusWriter``. The file appears only once
the worker serves (engine loaded, start-up probe done), so its absence means "still
starting".
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec


class OrchestratorStatus(msgspec.Struct, frozen=True):
    address: str
    accepted: bool | None  # None: no answer yet
    last_accepted_at: float = 0.0  # wall clock; 0: never
    reason: str = ""  # why it refused


class WorkerStatus(msgspec.Struct, frozen=True):
    worker_id: str
    role: str
    written_at: float  # wall clock
    engine_healthy: bool
    engine_problem: str = ""
    draining: bool = False
    orchestrators: tuple[OrchestratorStatus, ...] = ()


class StatusFileError(ValueError):
    """A status file that is missing, unreadable or not one a worker wrote."""


def write_status(path: Path, status: WorkerStatus) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(msgspec.json.encode(status))
    os.replace(temporary, path)


def read_status(path: Path) -> WorkerStatus:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise StatusFileError(f"no status file at {path} yet: the worker has not started serving") from None
    except OSError as error:
        raise StatusFileError(f"cannot read the status file {path}: {error}") from error
    try:
        return msgspec.json.decode(data, type=WorkerStatus)
    except msgspec.DecodeError as error:
        raise StatusFileError(f"{path} is not a worker status file: {error}") from error


class StatusWriter:
    """Turns the heartbeat sender's registrations into the status file. ``engine_problem``
    returns why the engine cannot serve, or "" when it can; ``draining`` whether the worker
    is draining."""

    def __init__(self, path: Path, worker_id: str, role: str, engine_problem: Callable[[], str],
                 draining: Callable[[], bool], clock: Callable[[], float] = time.time):
        self.path = path
        self._identity = (worker_id, role)
        self._engine_problem = engine_problem
        self._draining = draining
        self._clock = clock

    def __call__(self, registrations: dict) -> None:
        problem = self._engine_problem()
        orchestrators = tuple(OrchestratorStatus(address, r.accepted, r.last_accepted_at, r.reason)
                              for address, r in registrations.items())
        write_status(self.path, WorkerStatus(*self._identity, written_at=self._clock(), engine_healthy=not problem,
                                             engine_problem=problem, draining=self._draining(),
                                             orchestrators=orchestrators))


def status_writer(settings, engine_problem: Callable[[], str], draining: Callable[[], bool]) -> StatusWriter | None:
    """The writer of ``settings.status_file`` (a ``WorkerSettings``), or None without one."""
    if not settings.status_file:
        return None
    return StatusWriter(Path(settings.status_file), settings.worker_id, settings.role, engine_problem, draining)
