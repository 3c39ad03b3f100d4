"""The embedded cluster of a placement measurement, and how its KV caches are sized.

ONE cluster (``python -m kvroute serve``: orchestrator, 2 prefill workers, 1 decode
worker, ``--allow-policy-override``) per run, stopped with SIGINT like Ctrl-C.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from rich.console import Console

from foundation.netutil import free_port
from kvroute.bench.meters import wait_for_quiet
from kvroute.bench.paths import REPO_ROOT
from worker.block_size import CPU_BLOCK_SIZE
from worker.settings import WorkerSettings, default_long_prefill_tokens

console = Console(width=170)  # the table is wide; also when the output goes to a file

ALL_POLICIES = ("cache_aware", "round_robin", "least_loaded", "prefix_affinity", "block_cost")
MODEL = "SmolLM2-135M-Instruct"
# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x K,V, times the dtype's bytes.
KV_ELEMENTS_PER_TOKEN = 30 * 3 * 64 * 2
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
PREFILL_WORKERS, DECODE_WORKERS = 2, 1
MAX_MODEL_LEN = 4096
START_TIMEOUT_S = 900
# Other processes' load under which a measurement starts (--wait-quiet), over windows of this many seconds.
QUIET_CORES, QUIET_WINDOW_S = 0.3, 5.0


def checked_policies(parser, text: str) -> list[str]:
    """The comma-separated ``--policies``; unknown names or none end the command with a usage error."""
    policies = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in policies if p not in ALL_POLICIES]
    if unknown or not policies:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(ALL_POLICIES)}")
    return policies


def wait_quiet(budget: float) -> float:
    """``meters.wait_for_quiet`` at this measurement's threshold; seconds waited (0 without a budget)."""
    if budget <= 0:
        return 0.0
    return wait_for_quiet(budget, threshold=QUIET_CORES, window=QUIET_WINDOW_S,
                          say=lambda message: console.print(message, highlight=False))


class Cluster:
    """``python -m kvroute serve`` in its own process group; stopped with SIGINT like Ctrl-C."""

    def __init__(self, port: int, kv_cache_gib: float, dtype: str, log_path: Path):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.args = [sys.executable, "-m", "kvroute", "serve", "--port", str(port),
                     "--topology", f"{PREFILL_WORKERS}p{DECODE_WORKERS}d",
                     "--allow-policy-override", "--kv-cache-gib", f"{kv_cache_gib:.4f}", "--dtype", dtype,
                     "--max-model-len", str(MAX_MODEL_LEN), "--log-dir", str(log_path.parent / "workers")]
        # A process group of its own (stopped as one), in this process's session: with the cluster
        # in a session of its own, the scheduler's autogroups shared the CPU between the cluster
        # and this client as two groups, and under load the client sent requests up to 11 s late
        # (results/measure_placement_s14, max_send_lateness_s; see foundation.launcher.spawn).
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            cwd=REPO_ROOT, process_group=0)

    def wait_ready(self, timeout: float) -> list[dict]:
        """Until every worker registered (``/health`` needs only one of each role)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvroute serve exited early:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    workers = self.workers()
                    roles = Counter(w["role"] for w in workers)
                    if roles["prefill"] >= PREFILL_WORKERS and roles["decode"] >= DECODE_WORKERS:
                        return workers
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"kvroute serve not ready after {timeout:.0f} s; see {self.log_path}")

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/admin/workers", timeout=10).json()["workers"]

    def stop(self, timeout: float = 60) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            console.print("[yellow]cluster did not stop in time; SIGKILL to its process group[/]")
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait(10)


def start_cluster(args, kv_cache_gib: float, dtype: str, output: Path) -> tuple[Cluster, float]:
    """The cluster of ``args`` (``--port``), started once the machine is quiet (``--wait-quiet``),
    its log in ``output``; and the seconds waited for quiet."""
    waited = wait_quiet(args.wait_quiet)
    cluster = Cluster(args.port or free_port(), kv_cache_gib, dtype, output / "serve.log")
    console.print(f"cluster: {' '.join(cluster.args[1:])}", highlight=False)
    return cluster, waited


def worker_labels(workers: list[dict], log_dir: Path) -> dict[str, str]:
    """Worker id → "prefill@0"-style label naming the CPU core from the worker's log (the
    decode worker shares a core with a prefill worker); "prefill-0" style if logs lack it."""
    cores: dict[str, str] = {}
    for log in log_dir.glob("*.log"):
        text = log.read_text(errors="replace")
        worker = re.search(r'"worker_id": "([^"]+)"', text)
        core = re.search(r"core ids=\[([0-9, ]+)\]", text)
        if worker and core:
            cores[worker.group(1)] = core.group(1).replace(" ", "")
    labels: dict[str, str] = {}
    for role in ("prefill", "decode"):
        for k, wid in enumerate(sorted(w["worker_id"] for w in workers if w["role"] == role)):
            labels[wid] = f"{role}@{cores[wid]}" if wid in cores else f"{role}-{k}"
    if len(set(labels.values())) < len(labels):  # two workers of a role on one core
        labels = {wid: f"{label}#{k}" for k, (wid, label) in enumerate(labels.items())}
    return labels


# ---------------------------------------------------------------- sizing


def bytes_per_token(dtype: str) -> int:
    return KV_ELEMENTS_PER_TOKEN * DTYPE_BYTES[dtype]


def cache_gib(given: float | None, tokens: float, dtype: str) -> float:
    """Each worker's KV cache: ``--kv-cache-gib`` where given, else room for ``tokens``."""
    return given or round(tokens * bytes_per_token(dtype) / 2**30, 4)


def kv_cache_tokens(kv_cache_gib: float, dtype: str) -> float:
    """Tokens of KV one worker's cache holds (before vLLM rounds down to whole blocks)."""
    return kv_cache_gib * 2**30 / bytes_per_token(dtype)


def engine_record(kv_cache_gib: float, dtype: str) -> dict:
    """The workers' engine settings a simulation of the run needs (``simulator.from_replay``):
    cache size, block size, per-request step caps and eviction order, as the workers start
    by default on CPU."""
    return {"kv_cache_tokens_per_worker": kv_cache_tokens(kv_cache_gib, dtype), "block_size": CPU_BLOCK_SIZE,
            "long_prefill_tokens": {role: default_long_prefill_tokens(role) for role in ("prefill", "decode")},
            "evict_pulled_first": WorkerSettings.evict_pulled_first}
