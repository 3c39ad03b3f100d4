"""deploy/start-pool.sh and deploy/stop-pool.sh, with a fake interpreter instead of vLLM.

The fake "python" records its argv and environment and then sleeps, so the scripts'
own behaviour (arguments, pinning, pid files, process groups, logs, stopping) is
tested without starting an engine. nvidia-smi is overridden (NVIDIA_SMI) so the
result does not depend on whether the machine has GPUs.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
START = REPO_ROOT / "deploy" / "start-pool.sh"
STOP = REPO_ROOT / "deploy" / "stop-pool.sh"

FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for the interpreter: records how it was started, then idles like a worker.
out="$FAKE_RECORD_DIR/$$"
printf '%s\\n' "$@" > "$out.argv"
env > "$out.env"
echo "fake worker $$ started: $*"
trap 'echo "fake worker $$ got SIGTERM"; exit 0' TERM
sleep 300 &
wait
"""

FAKE_NVIDIA_SMI = """#!/bin/sh
echo "GPU 0: NVIDIA Fake (UUID: GPU-00000000-0000-0000-0000-000000000000)"
echo "GPU 1: NVIDIA Fake (UUID: GPU-11111111-1111-1111-1111-111111111111)"
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def fakes(tmp_path: Path) -> dict:
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    return {
        "python": _executable(tmp_path / "fake-python", FAKE_PYTHON),
        "nvidia_smi": _executable(tmp_path / "fake-nvidia-smi", FAKE_NVIDIA_SMI),
        "records": record_dir,
        "log_dir": tmp_path / "pool",
        "env": {**os.environ, "FAKE_RECORD_DIR": str(record_dir), "NVIDIA_SMI": str(tmp_path / "no-nvidia-smi"),
                "KVROUTE_POOL_STARTUP_CHECK": "0.5"},
    }


def run(script: Path, *args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=timeout)


def alive(pid: int) -> bool:
    """Exists and is not a zombie (nobody may reap an orphan quickly in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid and alive(int(entry.name)):
                    members.append(int(entry.name))
            except OSError:
                continue
    return members


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def records(record_dir: Path, pid: int) -> tuple[list[str], dict[str, str]]:
    assert wait_for(lambda: (record_dir / f"{pid}.env").exists()), f"fake worker {pid} recorded nothing"
    argv = (record_dir / f"{pid}.argv").read_text().splitlines()
    env = dict(line.split("=", 1) for line in (record_dir / f"{pid}.env").read_text().splitlines() if "=" in line)
    return argv, env


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]


def kill_group(pid: int | None) -> None:
    """Whatever a test left of a started worker's process group goes."""
    if pid is not None:
        try:
            os.killpg(pid, 9)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------- argument errors


@pytest.mark.parametrize("args, message", [
    (["prefill", "2"], "--orchestrator"),
    (["encode", "2", "--orchestrator", "tcp://127.0.0.1:7001"], "ROLE must be 'prefill', 'decode' or 'unified'"),
    (["prefill", "zero", "--orchestrator", "tcp://127.0.0.1:7001"], "COUNT must be a positive integer"),
    (["prefill", "0", "--orchestrator", "tcp://127.0.0.1:7001"], "COUNT must be a positive integer"),
    (["prefill", "auto", "--orchestrator", "tcp://127.0.0.1:7001"], "found no GPU"),
    (["prefill", "--orchestrator", "tcp://127.0.0.1:7001"], "expected ROLE and COUNT"),
    (["prefill", "1", "--orchestrator", "not an address"], "is not a registry address"),
    (["prefill", "1", "--orchestrator", "dns://kvroute-registry"], "is not a registry address"),
    (["prefill", "1", "--orchestrator"], "--orchestrator needs a value"),
    (["prefill", "1", "--orchestrator", "tcp://127.0.0.1:7001", "--kv-cache-gib", "1"], "unknown option"),
    (["prefill", "1", "--orchestrator", "tcp://127.0.0.1:7001", "--python", "/no/such/python"], "not found"),
    (["prefill", "1", "--orchestrator", "tcp://127.0.0.1:7001", "--node-store-gib", "0"], "positive number of GiB"),
    (["prefill", "1", "--orchestrator", "tcp://127.0.0.1:7001", "--node-store-gib", "lots"], "positive number"),
])

def test_start_pool_refuses_bad_arguments(fakes, args, message):
    check_refused(fakes, args, message, fakes["env"])


@pytest.mark.parametrize("args, message", [
    (["prefill", "1", "--orchestrator", "tcp://127.0.0.1:7001"], "--cluster-keys DIR is required"),
    (["prefill", "1", "--orchestrator", "tcp://127.0.0.1:7001", "--cluster-keys", "/no/such/keys"], "not a folder"),
    (["prefill", "1", "--orchestrator", "tcp://127.0.0.1:7001", "--cluster-keys", "/tmp", "--insecure-no-auth"],
     "exclude each other"),
])
def test_start_pool_needs_keys_or_an_explicit_insecure(fakes, args, message):
    env = {name: value for name, value in fakes["env"].items() if name != "KVROUTE_CLUSTER_KEYS"}
    check_refused(fakes, args, message, env)


def check_refused(fakes, args, message, env):
    result = run(START, *args, "--log-dir", str(fakes["log_dir"]), env=env)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert not list(fakes["records"].iterdir()), "nothing may start after a refusal"
    assert not list(fakes["log_dir"].glob("*.pid")) if fakes["log_dir"].exists() else True


@pytest.mark.parametrize("args, message", [
    (["encode"], "ROLE must be 'prefill', 'decode', 'unified' or 'node-store'"),
    (["--grace", "soon"], "--grace must be a whole number"),
    (["prefill", "decode"], "at most one ROLE"),
])
def test_stop_pool_refuses_bad_arguments(fakes, args, message):
    result = run(STOP, "--log-dir", str(fakes["log_dir"]), *args, env=fakes["env"])
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_help_exits_zero():
    for script in (START, STOP):
        result = run(script, "--help")
        assert result.returncode == 0 and "usage:" in result.stdout


# ---------------------------------------------------------------- a real run


def test_start_and_stop_a_cpu_pool(fakes):
    log_dir = fakes["log_dir"]
    started = run(START, "prefill", "2", "--orchestrator", "tcp://127.0.0.1:7001", "--orchestrator",
                  "dns://localhost:7002", "--log-dir", str(log_dir), "--python", str(fakes["python"]),
                  "--model", "/models/m", "--", "--kv-cache-gib", "0.5", env=fakes["env"])
    pids = []
    try:
        assert started.returncode == 0, started.stderr
        assert sorted(p.name for p in log_dir.glob("*.pid")) == ["prefill-0.pid", "prefill-1.pid"]
        pids = [int((log_dir / f"prefill-{i}.pid").read_text()) for i in range(2)]
        for i, pid in enumerate(pids):
            assert f"started prefill-{i}: pid {pid}, CPU core {i % os.cpu_count()}" in started.stdout
            assert alive(pid)
            assert os.getpgid(pid) == pid, "each worker leads its own process group"
            assert os.getsid(pid) == os.getsid(0), "in the caller's session: one scheduler autogroup"
            argv, env = records(fakes["records"], pid)
            assert argv[:3] == ["-m", "kvroute", "prefill-worker"]
            assert flag_values(argv, "--orchestrator") == ["tcp://127.0.0.1:7001", "dns://localhost:7002"]
            assert flag_values(argv, "--omp-threads-bind") == [str(i % os.cpu_count())]
            assert flag_values(argv, "--model") == ["/models/m"]
            assert flag_values(argv, "--cluster-keys") == [os.environ["KVROUTE_CLUSTER_KEYS"]]
            assert argv[-2:] == ["--kv-cache-gib", "0.5"], "extra flags come last, unchanged"
            assert env["FAKE_RECORD_DIR"] == str(fakes["records"])
            log = (log_dir / f"prefill-{i}.log").read_text()
            assert f"fake worker {pid} started: -m kvroute prefill-worker" in log
            assert "--omp-threads-bind " + str(i % os.cpu_count()) in log.splitlines()[0]

        again = run(START, "prefill", "2", "--orchestrator", "tcp://127.0.0.1:7001", "--log-dir", str(log_dir),
                    "--python", str(fakes["python"]), env=fakes["env"])
        assert again.returncode != 0 and "already running" in again.stderr
        assert [int((log_dir / f"prefill-{i}.pid").read_text()) for i in range(2)] == pids

        stopped = run(STOP, "--log-dir", str(log_dir), "--grace", "10", env=fakes["env"])
        assert stopped.returncode == 0, stopped.stderr
        for i, pid in enumerate(pids):
            assert f"stopped prefill-{i} (pid {pid}) with SIGTERM" in stopped.stdout
            assert wait_for(lambda pid=pid: not group_members(pid), 5), "the whole group is gone, sleep included"
            assert "got SIGTERM" in (log_dir / f"prefill-{i}.log").read_text()
        assert not list(log_dir.glob("*.pid"))

        second = run(STOP, "--log-dir", str(log_dir), env=fakes["env"])
        assert second.returncode == 0, second.stderr
        assert "nothing to stop" in second.stdout
    finally:
        for pid in pids:  # never leave sleepers behind, whatever failed above
            kill_group(pid)


def test_a_pool_with_a_node_store_starts_it_once_and_stops_it_with_the_workers(fakes):
    log_dir = fakes["log_dir"]
    common = ["--orchestrator", "tcp://127.0.0.1:7001", "--log-dir", str(log_dir), "--python", str(fakes["python"]),
              "--node-store-gib", "2"]
    first = run(START, "prefill", "1", *common, env=fakes["env"])
    second = run(START, "decode", "1", *common, env=fakes["env"])
    pids = []
    try:
        assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
        assert "started node-store-0" in first.stdout and "node store already running" in second.stdout
        pids = [int((log_dir / f"{name}.pid").read_text()) for name in ("node-store-0", "prefill-0", "decode-0")]
        store_argv, _ = records(fakes["records"], pids[0])
        assert store_argv[:3] == ["-m", "kvroute", "node-store"]
        assert flag_values(store_argv, "--host-kv-gib") == ["2"]
        assert flag_values(store_argv, "--bind") == ["tcp://127.0.0.1:7390"]
        assert flag_values(store_argv, "--cluster-keys") == [os.environ["KVROUTE_CLUSTER_KEYS"]]
        for pid in pids[1:]:
            argv, _ = records(fakes["records"], pid)
            assert flag_values(argv, "--node-store") == ["tcp://127.0.0.1:7390"]

        stopped = run(STOP, "--log-dir", str(log_dir), "--grace", "10", env=fakes["env"])
        assert stopped.returncode == 0, stopped.stderr
        assert f"stopped node-store-0 (pid {pids[0]}) with SIGTERM" in stopped.stdout
        assert wait_for(lambda: not any(group_members(pid) for pid in pids), 5)
        assert not list(log_dir.glob("*.pid"))
    finally:
        for pid in pids:
            kill_group(pid)


def test_gpu_pool_gets_one_gpu_each_and_stubborn_workers_are_killed(fakes, tmp_path):
    stubborn = _executable(tmp_path / "stubborn-python", FAKE_PYTHON.replace(
        """trap 'echo "fake worker $$ got SIGTERM"; exit 0' TERM""", "trap '' TERM"))
    env = {**fakes["env"], "NVIDIA_SMI": str(fakes["nvidia_smi"])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    log_dir = fakes["log_dir"]
    started = run(START, "decode", "auto", "--orchestrator", "10.0.0.1:7001", "--host", "10.0.0.2",
                  "--log-dir", str(log_dir), "--python", str(stubborn), env=env)
    pids = []
    try:
        assert started.returncode == 0, started.stderr
        pids = [int((log_dir / f"decode-{i}.pid").read_text()) for i in range(2)]
        for i, pid in enumerate(pids):
            argv, worker_env = records(fakes["records"], pid)
            assert worker_env["CUDA_VISIBLE_DEVICES"] == str(i)
            assert "--omp-threads-bind" not in argv
            assert flag_values(argv, "--orchestrator") == ["tcp://10.0.0.1:7001"]
            assert flag_values(argv, "--host") == ["10.0.0.2"]
            assert flag_values(argv, "--bind-host") == ["0.0.0.0"]

        too_many = run(START, "prefill", "3", "--orchestrator", "10.0.0.1:7001", "--log-dir", str(log_dir),
                       "--python", str(stubborn), env=env)
        assert too_many.returncode != 0 and "exceeds the 2 GPU(s)" in too_many.stderr

        # Only prefill pid files are asked for: the decode pool must stay up.
        none = run(STOP, "--log-dir", str(log_dir), "prefill", env=env)
        assert none.returncode == 0 and all(alive(pid) for pid in pids)

        stopped = run(STOP, "--log-dir", str(log_dir), "--grace", "1", "decode", env=env)
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.count("with SIGKILL after a 1 s grace period") == 2
        assert all(wait_for(lambda pid=pid: not group_members(pid), 5) for pid in pids)
        assert not list(log_dir.glob("*.pid"))
    finally:
        for pid in pids:
            kill_group(pid)


def test_stale_pid_files_are_cleaned_up(fakes):
    log_dir = fakes["log_dir"]
    log_dir.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (log_dir / "decode-0.pid").write_text(f"{dead.pid}\n")
    (log_dir / "decode-1.pid").write_text("garbage\n")
    stopped = run(STOP, "--log-dir", str(log_dir), env=fakes["env"])
    assert stopped.returncode == 0, stopped.stderr
    assert "not running" in stopped.stdout and "no valid pid" in stopped.stdout
    assert not list(log_dir.glob("*.pid"))


DRAINING_PYTHON = """#!/usr/bin/env bash
# A worker that drains for a second on SIGTERM, with an "engine" child in its group.
out="$FAKE_RECORD_DIR/$$"
"$FAKE_ENGINE" $$ "$out.engine" &
trap 'sleep 1; echo drained > "$out.drained"; exit 0' TERM
sleep 300 &
wait
"""

# Notes whether the worker ($1) was still running (a zombie is not) when it got SIGTERM.
FAKE_ENGINE = """#!/usr/bin/env bash
on_term() {
    case $(ps -o stat= -p "$1") in
        "" | Z*) echo after > "$2" ;;
        *) echo early > "$2" ;;
    esac
    exit 0
}
trap 'on_term "$1" "$2"' TERM
sleep 300 &
wait
"""


def test_stop_pool_lets_the_worker_drain_before_its_engine_processes_stop(fakes, tmp_path):
    draining = _executable(tmp_path / "draining-python", DRAINING_PYTHON)
    env = {**fakes["env"], "FAKE_ENGINE": str(_executable(tmp_path / "fake-engine", FAKE_ENGINE))}
    log_dir = fakes["log_dir"]
    started = run(START, "decode", "1", "--orchestrator", "tcp://127.0.0.1:7001", "--log-dir", str(log_dir),
                  "--python", str(draining), env=env)
    pid = None
    try:
        assert started.returncode == 0, started.stderr
        pid = int((log_dir / "decode-0.pid").read_text())
        stopped = run(STOP, "--log-dir", str(log_dir), "--grace", "10", env=fakes["env"])
        assert stopped.returncode == 0, stopped.stderr
        assert "stopped decode-0" in stopped.stdout and "with SIGTERM" in stopped.stdout
        assert (fakes["records"] / f"{pid}.drained").read_text().strip() == "drained"
        assert wait_for(lambda: (fakes["records"] / f"{pid}.engine").exists(), 5)
        assert (fakes["records"] / f"{pid}.engine").read_text().strip() == "after", \
            "the engine processes were signalled while the worker was still draining"
        assert wait_for(lambda: not group_members(pid), 5)
    finally:
        kill_group(pid)


def test_a_unified_pool_starts_unified_workers_and_stops_with_the_others(fakes):
    log_dir = fakes["log_dir"]
    started = run(START, "unified", "1", "--orchestrator", "tcp://127.0.0.1:7001", "--log-dir", str(log_dir),
                  "--python", str(fakes["python"]), env=fakes["env"])
    pid = None
    try:
        assert started.returncode == 0, started.stderr
        pid = int((log_dir / "unified-0.pid").read_text())
        argv, _ = records(fakes["records"], pid)
        assert argv[:3] == ["-m", "kvroute", "unified-worker"]
        stopped = run(STOP, "--log-dir", str(log_dir), "--grace", "10", env=fakes["env"])
        assert stopped.returncode == 0, stopped.stderr
        assert f"stopped unified-0 (pid {pid}) with SIGTERM" in stopped.stdout
        assert wait_for(lambda: not group_members(pid), 5)
    finally:
        kill_group(pid)
