"""Starting and stopping worker processes on this machine (tests, measurements, ``kvroute serve``).

Each worker runs as ``python -m <role>_worker`` in its own process group, announces
its addresses through a ready file, and is stopped with SIGTERM, which drains it
(``worker.drain``). Then its whole process group is stopped (SIGKILL after a
grace period), so that vLLM's own child processes go with it. With nothing running a
worker exits at once: stopping an idle pool (``kvroute serve`` stops its API first)
takes no longer than it did. A node KV store (``kvroute node-store``) is launched, made
ready and stopped the same way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

NODE_STORE = "node-store"  # the role name of a launched node store


class WorkerStartError(RuntimeError):
    pass


@dataclass
class LaunchedWorker:
    role: str
    process: subprocess.Popen
    ready_file: Path
    log_path: Path
    info: dict = field(default_factory=dict)

    @property
    def rpc_address(self) -> str:
        return self.info["rpc_address"]

    @property
    def transfer_address(self) -> str:
        return self.info["transfer_address"]

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.info = json.loads(self.ready_file.read_text())
                return self.info
            if self.process.poll() is not None:
                raise WorkerStartError(f"{self.role} worker exited with {self.process.returncode}; "
                                       f"see {self.log_path}:\n{tail(self.log_path)}")
            time.sleep(0.5)
        raise WorkerStartError(f"{self.role} worker not ready after {timeout:.0f} s; see {self.log_path}")

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the worker, which drains it; SIGKILL whatever of its group outlives ``grace``.

        The first SIGTERM goes to the worker alone: the group also holds vLLM's engine-core
        and model-worker processes, which abort their requests on a SIGTERM of their own,
        and which the worker stops itself once drained. They can outlive the worker's own
        process by a few seconds, so what is left of the group gets SIGTERM once it is gone.
        ``grace`` also bounds how long the worker's running requests get to finish.
        """
        stop_group(self.process, grace)
        self.process.wait(10)

    def kill(self) -> None:
        """Die at once, as a crashed worker would."""
        _signal_group(self.process, signal.SIGKILL)
        self.process.wait(10)


def stop_group(process: subprocess.Popen, grace: float) -> None:
    """SIGTERM the leader alone, then (once it is gone) the rest of its process group; SIGKILL
    whatever of the group outlives ``grace``. The caller reaps the leader."""
    deadline = time.monotonic() + grace
    process.send_signal(signal.SIGTERM)  # a no-op once the leader has been reaped
    _wait_until(lambda: process.poll() is not None, deadline)  # poll() reaps it, too
    _signal_group(process, signal.SIGTERM)
    _wait_until(lambda: not _group_alive(process), deadline)
    _signal_group(process, signal.SIGKILL)


def stop_all(workers: list[LaunchedWorker], grace: float = 20.0) -> None:
    """Stop workers side by side: each drains and shuts its engine down in seconds."""
    with ThreadPoolExecutor(max_workers=max(1, len(workers))) as pool:
        list(pool.map(lambda worker: worker.stop(grace), workers))


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _wait_until(condition, deadline: float) -> None:
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


def _group_alive(process: subprocess.Popen) -> bool:
    try:
        os.killpg(process.pid, 0)
        return True
    except ProcessLookupError:
        return False


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def error_lines(path: Path, limit: int = 3) -> str:
    """The last few distinct error lines of a log: usually the root cause of a failed start."""
    lines = [line for line in tail(path, 400).splitlines() if "Error:" in line]
    return "\n".join(dict.fromkeys(lines[-limit * 2:]).keys())


def spawn(command: list[str], log_path: Path, env: dict[str, str], own_session: bool = False) -> subprocess.Popen:
    """Start ``command`` logging to ``log_path``, leading a process group of its own (so that
    stopping it takes vLLM's child processes too) in the launcher's session.

    Not a session of its own: Linux's scheduler autogroups share CPU between sessions
    first, and spread a session's share over the cores where its threads run. A worker in
    a session of its own, whose engine core polled on one core, got almost nothing on the
    core its model runner is bound to whenever a busy engine of another session was bound
    there too: a 34-token prefill waited 9.4 s for a neighbour's 9 s prefill instead of
    taking 0.6-0.9 s (``kvroute bench core-sharing``). ``own_session`` is there for that
    comparison only."""
    placement = {"start_new_session": True} if own_session else {"process_group": 0}
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, **placement)


def launch_worker(role: str, args: list[str], log_dir: Path | None = None,
                  env: dict[str, str] | None = None, own_session: bool = False) -> LaunchedWorker:
    """Start ``python -m <role>_worker ARGS`` without waiting for it to be ready."""
    return _launch(role, ["-m", f"{role}_worker", *args], log_dir, env, own_session)


def launch_node_store(args: list[str], log_dir: Path | None = None) -> LaunchedWorker:
    """Start ``python -m kvroute node-store ARGS`` (the host's node KV store) without waiting
    for it; its ``info`` holds its ``address`` once ready. Stopped like a worker."""
    return _launch(NODE_STORE, ["-m", "kvroute", "node-store", *args], log_dir)


def _launch(name: str, python_args: list[str], log_dir: Path | None, env: dict[str, str] | None = None,
            own_session: bool = False) -> LaunchedWorker:
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvroute-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = f"{name}-{time.monotonic_ns()}"
    ready_file = log_dir / f"{stamp}.ready.json"
    log_path = log_dir / f"{stamp}.log"
    command = [sys.executable, *python_args, "--ready-file", str(ready_file)]
    process = spawn(command, log_path, {**os.environ, **(env or {})}, own_session)
    return LaunchedWorker(name, process, ready_file, log_path)
