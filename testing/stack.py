"""``kvroute serve`` as a user starts it, in a subprocess: for end-to-end tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from foundation.launcher import spawn
from foundation.netutil import free_port


class Stack:
    def __init__(self, cache_dir: Path | None, log_path: Path, extra_args: list[str]):
        """``cache_dir``: the model cache the stack uses (None: the default one)."""
        self.cache_dir = cache_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [sys.executable, "-m", "kvroute", "serve", "--port", str(self.port), *extra_args]
        env = {**os.environ, **({"KVROUTE_CACHE_DIR": str(cache_dir)} if cache_dir else {})}
        self.process = spawn(self.command, log_path, env)  # the caller's session: one autogroup with the client

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until /health answered 200; raises if serve exits or times out first."""
        return wait_healthy(self.url, [self.process], self.log_path, timeout)

    def workers(self, headers: dict | None = None) -> list[dict]:
        return httpx.get(self.url + "/admin/workers", timeout=5, headers=headers).json()["workers"]

    def stop(self, timeout: float = 60) -> int:
        """Ctrl-C, as a user would; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait(10)

    def leftover_processes(self) -> list[int]:
        """Processes that inherited this stack's environment (vLLM renames its children)."""
        marker = f"KVROUTE_CACHE_DIR={self.cache_dir}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0") and not _is_zombie(entry):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found


def listening_sockets(root_pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket listening in ``root_pid`` and its descendants."""
    pids = process_tree(root_pid)
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                address, port = local.split(":")
                found.append((_unhex_address(address, width), int(port, 16)))
    return found


def process_tree(root_pid: int) -> set[int]:
    """``root_pid`` and every process descended from it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, frontier = {root_pid}, [root_pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def _unhex_address(address: str, width: int) -> str:
    import ipaddress

    raw = bytes.fromhex(address)
    # /proc/net stores each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw)) if width == 8 else str(ipaddress.IPv6Address(raw))


def wait_healthy(url: str, processes: list[subprocess.Popen], log_path: Path, timeout: float) -> float:
    """Seconds until ``url``/health answered 200; raises if a process exits or time runs out first."""
    start = time.monotonic()
    deadline = start + timeout
    while time.monotonic() < deadline:
        if any(process.poll() is not None for process in processes):
            raise RuntimeError(f"a stack process exited early:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")


class SyntheticStack:
    """``kvroute orchestrator`` plus workers with synthetic engines (``testing.synthetic_worker``;
    by default one prefill and one decode worker), in subprocesses: the orchestrator's own
    cost without engine jitter, and worker faults in seconds. Same interface as ``Stack``.
    Worker ids are role-index (``decode-1``); ``worker_processes`` maps them to processes."""

    def __init__(self, model: str, log_path: Path, extra_args: list[str], token_seconds: float,
                 roles: tuple[str, ...] = ("prefill", "decode"), worker_args: tuple[str, ...] = (),
                 registry_by_name: bool = False):
        """``extra_args`` go to the orchestrator, ``worker_args`` to every worker;
        ``registry_by_name``: workers find the registry as ``dns://localhost:PORT``."""
        self.port, registry_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [sys.executable, "-m", "kvroute", "orchestrator", "--port", str(self.port),
                        "--registry-port", str(registry_port), "--model", model, *extra_args]
        self.registry = f"tcp://127.0.0.1:{registry_port}"  # where its workers heartbeat
        registry = f"dns://localhost:{registry_port}" if registry_by_name else self.registry
        worker_ids = [f"{role}-{roles[:i].count(role)}" for i, role in enumerate(roles)]
        workers = [[sys.executable, "-m", "testing.synthetic_worker", "--role", role, "--model", model,
                    "--worker-id", worker_id, "--orchestrator", registry, "--token-seconds", str(token_seconds),
                    *worker_args]
                   for role, worker_id in zip(roles, worker_ids)]
        with open(log_path, "wb") as log:
            self.processes = [subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, process_group=0)
                              for command in (self.command, *workers)]
        self.process = self.processes[0]  # the orchestrator
        self.worker_processes = dict(zip(worker_ids, self.processes[1:]))

    def wait_healthy(self, timeout: float) -> float:
        return wait_healthy(self.url, self.processes, self.log_path, timeout)

    def wait_workers(self, count: int, timeout: float) -> None:
        """Until ``count`` workers are live (health only needs one of each role)."""
        deadline = time.monotonic() + timeout
        while len(httpx.get(self.url + "/admin/workers", timeout=5).json()["workers"]) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {count} workers registered after {timeout:.0f} s")
            time.sleep(0.5)

    def stop(self, timeout: float = 30) -> int:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        codes = []
        for process in self.processes:
            try:
                codes.append(process.wait(timeout))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                codes.append(process.wait(10))
        return codes[0]


@contextmanager
def running_synthetic_stack(model: str, log_path: Path, extra_args: list[str], token_seconds: float,
                            roles: tuple[str, ...], worker_args: tuple[str, ...] = ()) -> Iterator[SyntheticStack]:
    """A ``SyntheticStack`` that is healthy with every worker registered; stopped on exit."""
    stack = SyntheticStack(model, log_path, extra_args, token_seconds=token_seconds, roles=roles,
                           worker_args=worker_args)
    try:
        stack.wait_healthy(300)
        stack.wait_workers(len(roles), 120)
        yield stack
    finally:
        stack.stop()


def _is_zombie(proc: Path) -> bool:
    try:
        return " Z " in (proc / "stat").read_text().split(")", 1)[1][:4]
    except OSError:
        return True
