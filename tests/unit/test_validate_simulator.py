"""``kvroute bench validate-simulator`` on a trace run (``kvroute bench trace``'s results): the
requests rebuilt request for request, the engines of runs that did not record them, and a
whole validation of a run the simulator itself made (a repository-assistant run as well)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.bench.placement.cluster import engine_record, kv_cache_tokens
from kvroute.bench.simulation import validate as validate_simulator
from simulator.from_replay import calibration_from_replay, cluster_from_replay
from tests.unit.simulated_runs import (
    KV_CACHE_GIB,
    POLICIES,
    simulated_repository_run,
    simulated_trace_run,
    trace_run,
    write_trace,
)


@pytest.fixture(scope="module")
def simulated_run(tmp_path_factory) -> Path:
    """Validating a run the simulator made must find the simulator agreeing with itself."""
    return simulated_trace_run(tmp_path_factory.mktemp("trace_run"))


def test_a_trace_run_is_rebuilt_request_for_request(simulated_run):
    results = json.loads(simulated_run.read_text())
    requests, check = validate_simulator.rebuild_requests(results)
    assert check == {"rows_checked": 64, "rows_mismatched": 0, "requests": 32}
    assert [r.index for r in requests] == list(range(32))
    results["requests"][5]["prompt_tokens"] += 1
    results["requests"][9]["repository"] += 1
    assert validate_simulator.rebuild_requests(results)[1]["rows_mismatched"] == 2


def test_a_trace_run_without_engine_settings_gets_the_workers_defaults(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(trace_run(write_trace(tmp_path / "trace.jsonl"), recorded_engines=False)))
    results, _, _ = validate_simulator.load_real(path)
    assert results["workload"] == engine_record(KV_CACHE_GIB, "float32")
    cluster = cluster_from_replay(results)
    assert cluster.engine.num_blocks == int(kv_cache_tokens(KV_CACHE_GIB, "float32")) // 32
    assert calibration_from_replay(results).bytes_per_token == 30 * 3 * 64 * 2 * 4  # SmolLM2 in float32


@pytest.fixture(scope="module")
def repository_run(tmp_path_factory) -> Path:
    return simulated_repository_run(tmp_path_factory.mktemp("repository_run"))


@pytest.mark.parametrize("run", ["simulated_run", "repository_run"])
def test_the_simulator_validates_a_run_it_made(run, request, tmp_path):
    path = request.getfixturevalue(run)
    assert validate_simulator.main(["--real", str(path), "--seeds", "2", "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "validation.json").read_text())
    run_results = json.loads(path.read_text())
    assert report["request_check"]["rows_mismatched"] == 0
    assert report["request_check"]["rows_checked"] == len(run_results["requests"])
    model = next(iter(report["comparison"].values()))  # the first variant is the model itself
    real = run_results["summaries"]
    for policy in POLICIES:
        assert model[policy]["within_band"], (policy, model[policy]["p50_ratio"])
        assert model[policy]["sim_hit_rate"] == pytest.approx(real[policy]["hit_rate"], abs=0.02)


def test_scaling_a_trace_run_is_refused(simulated_run, tmp_path):
    with pytest.raises(SystemExit, match="repository-assistant"):
        validate_simulator.main(["--real", str(simulated_run), "--scale", "--output", str(tmp_path)])
