"""``kvroute serve`` as a user starts it, in a subprocess: for end-to-end tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvroute.netutil import free_port


class Stack:
    def __init__(self, cache_dir: Path | None, log_path: Path, extra_args: list[str]):
        """``cache_dir``: the model cache the stack uses (None: the default one)."""
        self.cache_dir = cache_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [sys.executable, "-m", "kvroute", "serve", "--port", str(self.port), *extra_args]
        env = {**os.environ, **({"KVROUTE_CACHE_DIR": str(cache_dir)} if cache_dir else {})}
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until /health answered 200; raises if serve exits or times out first."""
        start = time.monotonic()
        deadline = start + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvroute serve exited early:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"kvroute serve not healthy after {timeout:.0f} s")

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


def _is_zombie(proc: Path) -> bool:
    try:
        return " Z " in (proc / "stat").read_text().split(")", 1)[1][:4]
    except OSError:
        return True
