"""``kvroute bench peers``: the equal-resources rules, each peer's command lines, the workloads at a
rate, the router's pinned install and the command's argument checks. Pure: nothing is started."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvroute.bench.paths import DEFAULT_TRACE
from kvroute.bench.peers import cli, plans, router_env, sources
from kvroute.bench.peers.resources import Resources
from orchestrator.planner.settings import DEFAULT_TPOT_TARGET_SECONDS, PlannerSettings
from workloads.trace import TraceRecord, TraceScaling, scale_trace

RES = Resources(model="/models/smol", dtype="float32", total_kv_gib=0.75, max_model_len=4096, cores=(0, 1))
OPTIONS = plans.PeerOptions(router_binary="/venv/bin/vllm-router")


def ports():
    counter = itertools.count(20000)
    return lambda: next(counter)


def flag(argv, name: str) -> str:
    return argv[argv.index(name) + 1]


def test_one_vllm_server_gets_every_core_and_the_whole_budget():
    plan = plans.vllm_plan(RES, OPTIONS, ports())
    (server,) = plan.launches
    argv, env = list(server.argv), dict(server.env)
    assert flag(argv, "--kv-cache-memory-bytes") == str(int(0.75 * 2**30))
    assert [flag(argv, name) for name in ("--block-size", "--dtype", "--max-model-len")] == ["32", "float32", "4096"]
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--served-model-name") == "SmolLM2-135M-Instruct"
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(argv)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert plan.reset == plans.RESET_ENGINES and plan.engine_urls == (plan.url,) and not plan.kvroute_api


def test_router_servers_split_cores_and_budget_and_the_router_restarts_between_runs():
    plan = plans.router_plan("cache_aware", RES, OPTIONS, ports())
    servers = [launch for launch in plan.launches if launch.name.startswith("vllm-")]
    router = plan.launches[-1]
    assert [dict(s.env)["VLLM_CPU_OMP_THREADS_BIND"] for s in servers] == ["0", "1"]
    assert {int(flag(list(s.argv), "--kv-cache-memory-bytes")) for s in servers} == {int(0.75 * 2**30) // 2}
    assert router.argv[0] == "/venv/bin/vllm-router" and flag(list(router.argv), "--policy") == "cache_aware"
    assert router.restart_between_runs and not any(s.restart_between_runs for s in servers)
    assert flag(list(router.argv), "--host") == "127.0.0.1" and "--kv-event-source" not in router.argv
    assert plan.engine_urls == tuple(f"http://127.0.0.1:{flag(list(s.argv), '--port')}" for s in servers)


def test_kv_aware_routes_on_events_relayed_over_loopback():
    plan = plans.router_plan("kv_aware", RES, OPTIONS, ports())
    relays = [launch for launch in plan.launches if launch.name.startswith("event-relay")]
    servers = [launch for launch in plan.launches if launch.name.startswith("vllm-")]
    router = list(plan.launches[-1].argv)
    assert len(relays) == 2 and flag(router, "--kv-event-block-size") == "32"
    for relay, server in zip(relays, servers):
        inbound, outbound = flag(list(relay.argv), "--inbound"), flag(list(relay.argv), "--outbound")
        config = json.loads(flag(list(server.argv), "--kv-events-config"))
        assert config["endpoint"] == inbound and "*" not in inbound and "127.0.0.1" in outbound
        assert "--enable-scale-out" in server.argv  # the router renders prompts through the server
        assert f"http://127.0.0.1:{flag(list(server.argv), '--port')}={outbound}" in router


def test_kvroute_gets_its_topology_and_the_total_budget():
    plan = plans.kvroute_plan(RES, plans.PeerOptions(kvroute_topology="2p1d", kvroute_args=("--policy", "x")),
                              ports(), Path("/logs"))
    argv = list(plan.launches[0].argv)
    assert (flag(argv, "--topology"), flag(argv, "--total-kv-gib"), flag(argv, "--host")) == ("2p1d", "0.75",
                                                                                              "127.0.0.1")
    assert argv[-2:] == ["--policy", "x"] and plan.kvroute_api and plan.reset == plans.RESET_KVROUTE
    # What a later simulation of the run needs to plan as it did (kvroute bench fit-shapes).
    assert plan.settings["planner_defaults"] == {"max_in_flight_per_worker": PlannerSettings().max_in_flight,
                                                 "tpot_target_seconds": DEFAULT_TPOT_TARGET_SECONDS}


def test_kvroute_tier_adds_a_node_store_of_a_multiple_of_the_budget():
    plan = plans.kvroute_plan(RES, plans.PeerOptions(kvroute_topology="2p1d", tier_kv_multiple=8), ports(),
                              Path("/logs"), tier=True)
    argv = list(plan.launches[0].argv)
    assert (plan.system, flag(argv, "--total-kv-gib"), flag(argv, "--host-kv-gib")) == ("kvroute-tier", "0.75", "6")
    assert flag(argv, "--log-dir") == "/logs/kvroute-tier-workers" and plan.settings["host_kv_gib"] == 6
    assert "--host-kv-gib" not in plans.kvroute_plan(RES, plans.PeerOptions(), ports(), Path("/logs")).launches[0].argv
    assert plans.KVROUTE_TIER in plans.SYSTEMS and plans.KVROUTE_TIER not in plans.DEFAULT_SYSTEMS
    assert plans.ROUTER_PD in plans.SYSTEMS and plans.ROUTER_PD not in plans.DEFAULT_SYSTEMS


def test_router_pd_runs_only_where_the_nixl_package_imports(monkeypatch):
    monkeypatch.setattr(plans, "find_spec", lambda name: object())
    assert plans.pd_skip_reason() == ""
    monkeypatch.setattr(plans, "find_spec", lambda name: None if name == "nixl" else object())
    assert "nixl" in plans.pd_skip_reason() and "P/D" in plans.pd_skip_reason()


def test_router_pd_joins_a_prefill_and_a_decode_server_by_vllms_nixl_connector_on_loopback():
    plan = plans.router_pd_plan(RES, OPTIONS, ports())
    *servers, router = plan.launches
    assert plan.system == "router-pd" and len(servers) == 2 and plan.reset == plans.RESET_ENGINES
    roles, side_channels = [], set()
    for server in servers:
        config = json.loads(flag(list(server.argv), "--kv-transfer-config"))
        assert (config["kv_connector"], config["kv_buffer_device"]) == ("NixlConnector", "cpu")
        roles.append(config["kv_role"])
        env = dict(server.env)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        side_channels.add(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        assert flag(list(server.argv), "--kv-cache-memory-bytes") == str(RES.kv_bytes_each(2))
    assert roles == ["kv_producer", "kv_consumer"] and len(side_channels) == 2
    argv = list(router.argv)
    assert "--vllm-pd-disaggregation" in argv and flag(argv, "--kv-connector") == "nixl"
    assert flag(argv, "--prefill") == f"http://127.0.0.1:{flag(list(servers[0].argv), '--port')}"
    assert flag(argv, "--decode") == f"http://127.0.0.1:{flag(list(servers[1].argv), '--port')}"
    assert [dict(s.env)["VLLM_CPU_OMP_THREADS_BIND"] for s in servers] == ["0", "1"]  # a core each


def test_router_install_is_detected_by_its_pinned_release(tmp_path):
    assert not router_env.installed(tmp_path)
    (tmp_path / "lib/python3.11/site-packages/vllm_router-0.1.17.dist-info").mkdir(parents=True)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/vllm-router").touch()
    assert router_env.installed(tmp_path)
    assert router_env.ensure_router(tmp_path, say=pytest.fail) == tmp_path / "bin/vllm-router"  # no reinstall
    assert not router_env.installed(tmp_path, version="0.1.16")


@pytest.mark.parametrize("workload", ["repository-assistant", "long-output", "conversation"])
def test_chat_workloads_give_the_requests_asked_for_at_about_the_rate(workload):
    items, source = sources.items(workload, 2.0, sources.SourceSettings(requests=24))
    assert len(items) == 24 and all(item.endpoint == "/v1/chat/completions" for item in items)
    rate = (len(items) - 1) / items[-1].arrival_seconds
    assert 0.8 < rate < 5  # Poisson arrivals (conversations: turns after think times), around 2/s
    if workload == "long-output":
        assert set(sources.requested_lengths(items).values()) == {256}


def test_the_trace_is_retimed_to_the_rate():
    if not DEFAULT_TRACE.exists():
        pytest.skip("no Mooncake trace beside the checkout")
    items, source = sources.items("trace", 0.5, sources.SourceSettings(requests=10, trace=DEFAULT_TRACE))
    assert len(items) == 10 and items[0].arrival_seconds == 0 and items[-1].arrival_seconds == pytest.approx(18)
    assert all(item.endpoint == "/v1/completions" for item in items) and source["replayed"] == 10
    _, longer = sources.items("trace", 0.5, sources.SourceSettings(requests=60, trace=DEFAULT_TRACE))
    assert source["unlimited_cache_hit_rate"] <= longer["unlimited_cache_hit_rate"] < 1
    assert longer["unlimited_cache_hit_rate"] > 0.1, "60 requests of the sample share prefixes"


def test_requests_that_arrived_at_once_are_spread_evenly():
    records = [TraceRecord(timestamp=0, input_length=100, output_length=5, hash_ids=[k]) for k in range(3)]
    requests = sources.retimed(scale_trace(records, TraceScaling()).requests, rate=2.0)
    assert [r.arrival_seconds for r in requests] == [0.0, 0.5, 1.0]


@pytest.mark.parametrize("argv", [["--systems", "nope"], ["--workloads", "chat"], ["--rates", "0"],
                                  ["--rates", "fast"], ["--requests", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        cli.COMMAND.parse_args(argv)


def test_arguments_are_parsed_into_lists():
    args = cli.COMMAND.parse_args(["--systems", "vllm, router-cache_aware", "--rates", "1,0.5,1"])
    assert args.systems == ["vllm", "router-cache_aware"] and args.rates == [0.5, 1.0]


def test_router_pd_beside_other_systems_needs_sequential_runs(capsys):
    with pytest.raises(SystemExit):
        cli.COMMAND.parse_args(["--systems", "kvroute,router-pd"])
    assert "--sequential" in capsys.readouterr().err
    assert cli.COMMAND.parse_args(["--systems", "kvroute,router-pd", "--sequential"]).sequential
    assert cli.COMMAND.parse_args(["--systems", "router-pd"]).systems == ["router-pd"]
