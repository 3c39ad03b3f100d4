"""The worker's status file and ``kvroute probe worker`` (worker.status_file, worker.probe):
alive while heartbeats are current and the engine is healthy, draining or not; ready only
when also registered, refused by no orchestrator, and not draining."""

from __future__ import annotations

import pytest

from kvroute.cli import main
from worker.heartbeat import Registration
from worker.probe import judge, probe
from worker.status_file import OrchestratorStatus, StatusWriter, WorkerStatus

NOW = 1_000.0


def status(written_at=NOW - 1, engine_problem="", draining=False, orchestrators=None) -> WorkerStatus:
    if orchestrators is None:
        orchestrators = (OrchestratorStatus("tcp://10.0.0.1:7001", True, NOW - 1),
                         OrchestratorStatus("tcp://10.0.0.2:7001", None))
    return WorkerStatus("decode-0", "decode", written_at, engine_healthy=not engine_problem,
                        engine_problem=engine_problem, draining=draining, orchestrators=orchestrators)


@pytest.mark.parametrize("given, live, ready, reason", [
    (status(), True, True, "registered with 1 of 2"),
    (status(written_at=NOW - 30), False, False, "heartbeat loop has stopped"),
    (status(engine_problem="the vLLM engine core is dead"), False, False, "engine core is dead"),
    (status(draining=True), True, False, "draining"),
    (status(orchestrators=()), True, False, "none of 0 orchestrators"),
    (status(orchestrators=(OrchestratorStatus("tcp://10.0.0.1:7001", True, NOW - 30),)), True, False,
     "none of 1 orchestrators accepted a heartbeat in the last 10 s"),
    (status(orchestrators=(OrchestratorStatus("tcp://10.0.0.1:7001", True, NOW - 1),
                           OrchestratorStatus("tcp://10.0.0.2:7001", False, 0.0, "model differs"))),
     True, False, "tcp://10.0.0.2:7001: model differs"),
])
def test_live_and_ready(given, live, ready, reason):
    assert judge(given, "live", NOW, max_age=10).ok is live
    result = judge(given, "ready", NOW, max_age=10)
    assert result.ok is ready
    assert reason in (result.reason if live else judge(given, "live", NOW, max_age=10).reason)


def test_the_writer_records_what_each_orchestrator_said_and_the_probe_reads_it(tmp_path):
    path = tmp_path / "status.json"
    writer = StatusWriter(path, "unified-0", "unified", engine_problem=lambda: "", draining=lambda: False,
                          clock=lambda: NOW)
    writer({"tcp://10.0.0.1:7001": Registration(accepted=True, last_accepted_at=NOW - 2),
            "tcp://10.0.0.2:7001": Registration(accepted=None, unreachable=True)})
    assert probe(path, "ready", max_age=10, now=NOW).ok
    assert not probe(path, "ready", max_age=10, now=NOW + 20).ok
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # written by rename, nothing left beside it


def test_a_missing_or_foreign_file_fails_saying_why(tmp_path):
    assert "has not started serving" in probe(tmp_path / "none.json", "live", 10).reason
    (tmp_path / "other.json").write_text('{"hello": 1}')
    assert "not a worker status file" in probe(tmp_path / "other.json", "live", 10).reason


def test_the_command_exits_0_or_1_with_one_line(tmp_path, capsys):
    path = tmp_path / "status.json"
    StatusWriter(path, "prefill-0", "prefill", lambda: "", lambda: True)({})
    assert main(["probe", "worker", "--status-file", str(path), "--max-age", "30"]) == 0
    assert main(["probe", "worker", "--status-file", str(path), "--check", "ready"]) == 1
    assert capsys.readouterr().out.splitlines() == ["alive: heartbeats current, engine healthy, draining",
                                                    "draining: finishing its requests, taking no new ones"]
