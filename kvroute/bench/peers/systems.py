"""Starting a peer's processes, emptying its caches between runs, and stopping every one of them.

Lifecycle of one system (``run.sweep`` drives it)::

    start:  engines (and relays) side by side ─▶ each ready ─▶ fronts (a router) ─▶ ready
    per run: reset ─▶ replay            reset: kvroute: POST /admin/reset-cache (and wait
                                                until its index is empty);
                                               vLLM: POST /reset_prefix_cache on every server,
                                                then restart the router (its own prefix tree
                                                has no reset), a fresh log per start
    stop:   fronts first, then the rest: SIGTERM to the leader, then to its process group,
            SIGKILL to the group after the grace period (vLLM's engine processes go with it)

Every process leads a process group of its own in this process's session
(``foundation.launcher.spawn``), logs to ``<log_dir>/<system>-<name>.log``, and is stopped on
any exit of ``running`` (error and Ctrl-C included).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from foundation.launcher import spawn, stop_group, tail
from kvroute.bench.peers.plans import RESET_KVROUTE, Launch, Plan
from kvroute.bench.replay_server import ReplayServer

RESET_ATTEMPTS = 20
RESET_RETRY_S = 0.5
POLL_S = 0.25
Warn = Callable[[str], None]


class SystemStartError(RuntimeError):
    """A process of a system exited or was not ready in time; the message ends with its log's tail."""


class Process:
    """One launched process and its process group."""

    def __init__(self, launch: Launch, log_path: Path):
        self.launch = launch
        self.log_path = log_path
        self.popen = spawn(list(launch.argv), log_path, {**os.environ, **dict(launch.env)})

    def is_ready(self) -> bool:
        if self.launch.ready_log and self.launch.ready_log not in _read(self.log_path):
            return False
        if not self.launch.ready_url:
            return True
        try:
            return httpx.get(self.launch.ready_url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def failure(self, why: str) -> SystemStartError:
        return SystemStartError(f"{self.launch.name} {why}; {self.log_path}:\n{tail(self.log_path, 15)}")

    def stop(self, grace: float) -> None:
        """SIGTERM the leader (kvroute serve then stops its own workers), then its group; SIGKILL
        what is left of the group after ``grace``."""
        stop_group(self.popen, grace)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)


def wait_ready(processes: list[Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = list(processes)
    while waiting:
        for process in list(waiting):
            if process.popen.poll() is not None:
                raise process.failure(f"exited with {process.popen.returncode} while starting")
            if process.is_ready():
                waiting.remove(process)
        if waiting and time.monotonic() > deadline:
            raise waiting[0].failure(f"not ready after {timeout:.0f} s")
        if waiting:
            time.sleep(POLL_S)


class RunningSystem:
    """A started ``Plan``: ``url`` takes requests; ``reset_cache`` before each run; ``stop`` once."""

    def __init__(self, plan: Plan, log_dir: Path, start_timeout: float, grace: float = 60):
        self.plan = plan
        self.log_dir = log_dir
        self.start_timeout = start_timeout
        self.grace = grace
        self.processes: list[Process] = []
        self.starts: dict[str, int] = {}

    @property
    def url(self) -> str:
        return self.plan.url

    def start(self) -> None:
        backends = [launch for launch in self.plan.launches if not launch.restart_between_runs]
        fronts = [launch for launch in self.plan.launches if launch.restart_between_runs]
        wait_ready([self._launch(launch) for launch in backends], self.start_timeout)
        wait_ready([self._launch(launch) for launch in fronts], self.start_timeout)

    def _launch(self, launch: Launch) -> Process:
        count = self.starts[launch.name] = self.starts.get(launch.name, 0) + 1
        suffix = f".{count}" if launch.restart_between_runs else ""
        process = Process(launch, self.log_dir / f"{self.plan.system}-{launch.name}{suffix}.log")
        self.processes.append(process)
        return process

    def front_logs(self) -> list[Path]:
        """The current logs of the processes restarted between runs (a router's)."""
        return [p.log_path for p in self.processes if p.launch.restart_between_runs and p.popen.poll() is None]

    def reset_cache(self, model: str, warn: Warn) -> dict:
        """Empty every cache, so the next run starts cold; what happened, for results.json."""
        if self.plan.reset == RESET_KVROUTE:
            server = ReplayServer(self.url)
            try:
                return {"method": "POST /admin/reset-cache", **server.reset_cache(model, warn)}
            finally:
                server.close()
        report = {"method": "POST /reset_prefix_cache on every vLLM server",
                  "reset": all(_reset_engine(engine, warn) for engine in self.plan.engine_urls)}
        if any(launch.restart_between_runs for launch in self.plan.launches):
            self._restart_fronts()
            report["router_restarted"] = True
        return report

    def _restart_fronts(self) -> None:
        fronts = [p for p in self.processes if p.launch.restart_between_runs]
        for process in fronts:
            process.stop(self.grace)
            self.processes.remove(process)
        wait_ready([self._launch(process.launch) for process in fronts], self.start_timeout)

    def stop(self) -> None:
        """Fronts first (no request reaches a stopping engine), then the rest in reverse order."""
        ordered = sorted(reversed(self.processes), key=lambda p: not p.launch.restart_between_runs)
        for process in ordered:
            process.stop(self.grace)
        self.processes.clear()


@contextlib.contextmanager
def running(plan: Plan, log_dir: Path, start_timeout: float) -> Iterator[RunningSystem]:
    """``plan``'s processes, ready; all of them stopped on leaving, however that happens."""
    system = RunningSystem(plan, log_dir, start_timeout)
    try:
        system.start()
        yield system
    finally:
        system.stop()


def _reset_engine(engine: str, warn: Warn) -> bool:
    """vLLM refuses a reset while blocks are held (a request still finishing): retry a while."""
    for _ in range(RESET_ATTEMPTS):
        try:
            reply = httpx.post(engine + "/reset_prefix_cache", timeout=30)
            if reply.status_code == 200 and reply.json().get("success"):
                return True
            if reply.status_code in (404, 405):
                warn(f"{engine} has no /reset_prefix_cache (VLLM_SERVER_DEV_MODE unset?); its cache stays warm")
                return False
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(RESET_RETRY_S)
    warn(f"{engine} kept refusing /reset_prefix_cache; its cache stays warm")
    return False


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""

