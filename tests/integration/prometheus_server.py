"""A real Prometheus server for a test: Debian's ``prometheus`` binary (``make setup`` installs
it), with its own config, a temporary storage folder, a free loopback port, scraping one
target every second and evaluating rule files every second; stopped on exit. It never
touches a system Prometheus service the package may have set up."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from foundation.netutil import free_port

SCRAPE_SECONDS = 1


def require_binaries() -> None:
    """Fail, not skip: ``make setup`` installs them, so their absence is a broken set-up."""
    missing = [name for name in ("prometheus", "promtool") if shutil.which(name) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not on PATH: `make setup` installs Debian's prometheus package")


class Prometheus:
    def __init__(self, url: str, process: subprocess.Popen, log_path: Path):
        self.url, self.process, self.log_path = url, process, log_path

    def query(self, expr: str) -> list[dict]:
        """The instant vector ``expr`` evaluates to now (raises on a query error)."""
        reply = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10).json()
        if reply["status"] != "success":
            raise AssertionError(f"{expr}: {reply.get('errorType')}: {reply.get('error')}")
        return reply["data"]["result"]

    def wait_for(self, expr: str, ready: Callable[[list[dict]], bool], timeout: float) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if ready(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr} still {result} after {timeout:.0f} s\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self) -> str:
        return self.log_path.read_text()[-2000:]


def finite_values(result: list[dict]) -> list[float]:
    return [value for value in (float(series["value"][1]) for series in result) if math.isfinite(value)]


@contextmanager
def running_prometheus(folder: Path, target: str, rule_files: list[Path], timeout: float = 30) -> Iterator[Prometheus]:
    """``target``: host:port whose /metrics is scraped, as job ``kvroute``."""
    config = {"global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "evaluation_interval": f"{SCRAPE_SECONDS}s"},
              "rule_files": [str(path.resolve()) for path in rule_files],
              "scrape_configs": [{"job_name": "kvroute", "static_configs": [{"targets": [target]}]}]}
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = folder / "prometheus.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(["prometheus", f"--config.file={folder / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0)
    server = Prometheus(f"http://127.0.0.1:{port}", process, log_path)
    try:
        _wait_ready(server, timeout)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def _wait_ready(server: Prometheus, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"prometheus exited:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/-/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"prometheus not ready after {timeout:.0f} s:\n{server.log_tail()}")
