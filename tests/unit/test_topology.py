"""``kvroute serve``'s topology: parsing shapes, what ``auto`` picks, cores and KV budgets."""

from __future__ import annotations

import pytest

from kvroute.serve import PoolSettings, worker_args
from kvroute.topology import TopologyError, cpu_list, parse_spec, plan_topology, split_cores
from orchestrator.settings import OrchestratorSettings


@pytest.mark.parametrize("spec, counts", [
    ("1u", {"prefill": 0, "decode": 0, "unified": 1}),
    ("2p1d", {"prefill": 2, "decode": 1, "unified": 0}),
    ("1p1d2u", {"prefill": 1, "decode": 1, "unified": 2}),
    (" 2U ", {"prefill": 0, "decode": 0, "unified": 2}),
    ("1p1p1d", {"prefill": 2, "decode": 1, "unified": 0}),
])
def test_specs_parse_to_counts_per_role(spec, counts):
    assert parse_spec(spec) == counts


@pytest.mark.parametrize("spec, message", [
    ("", "not 'auto' nor counts and roles"),
    ("2x", "not 'auto' nor counts and roles"),
    ("u", "not 'auto' nor counts and roles"),
    ("1u extra", "not 'auto' nor counts and roles"),
    ("0u", "has no workers"),
    ("2p", "needs a unified worker, or prefill and decode workers both"),
    ("3d", "needs a unified worker, or prefill and decode workers both"),
])
def test_bad_specs_are_refused_with_a_reason(spec, message):
    with pytest.raises(TopologyError, match=message):
        parse_spec(spec)


def test_auto_on_two_cores_is_one_unified_engine_on_both():
    topology = plan_topology("auto", cores=[0, 1], gpus=0, kv_cache_gib=0.5, total_kv_gib=0.75)
    assert topology.spec == "1u"
    assert [(e.role, e.cores, e.kv_cache_gib) for e in topology.engines] == [("unified", "0-1", 0.75)]
    assert "2 CPU core(s)" in topology.reason


def test_auto_on_many_cores_splits_them_between_unified_engines():
    topology = plan_topology("auto", cores=list(range(32)), gpus=0, kv_cache_gib=1.0, cores_per_engine=8)
    assert topology.spec == "4u"
    assert [e.cores for e in topology.engines] == ["0-7", "8-15", "16-23", "24-31"]
    assert {e.kv_cache_gib for e in topology.engines} == {1.0}  # no total given: each its own


def test_auto_with_gpus_is_one_unified_engine_per_gpu():
    topology = plan_topology("auto", cores=list(range(16)), gpus=2, kv_cache_gib=4.0)
    assert topology.spec == "2u"
    assert [(e.gpu, e.cores) for e in topology.engines] == [(0, ""), (1, "")]


def test_given_shape_splits_the_total_kv_and_the_cores():
    topology = plan_topology("2p1d", cores=[0, 1], gpus=0, kv_cache_gib=0.5, total_kv_gib=0.75)
    assert topology.reason == "given"
    assert [(e.role, e.cores) for e in topology.engines] == [("prefill", "0"), ("prefill", "1"), ("decode", "0")]
    assert [e.kv_cache_gib for e in topology.engines] == [0.25] * 3


@pytest.mark.parametrize("cores, engines, expected", [
    ([0, 1], 1, ["0-1"]),
    ([0, 1], 2, ["0", "1"]),
    ([0, 1, 2], 2, ["0-1", "2"]),
    ([4, 5, 9], 1, ["4-5,9"]),
    ([2, 3], 3, ["2", "3", "2"]),
])
def test_cores_are_split_into_groups_of_their_own(cores, engines, expected):
    assert split_cores(cores, engines) == expected


def test_cpu_list_reads_as_omp_bind_takes_it():
    assert cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"


def test_described_topology_names_every_engine():
    described = plan_topology("1p1d", cores=[0, 1], gpus=0, kv_cache_gib=0.5).describe()
    assert described["spec"] == "1p1d"
    assert [e["role"] for e in described["engines"]] == ["prefill", "decode"]


def test_worker_args_bind_cores_and_budget_of_their_engine():
    engine = plan_topology("1u", cores=[0, 1], gpus=0, kv_cache_gib=0.5, total_kv_gib=0.75).engines[0]
    args = worker_args(PoolSettings(), OrchestratorSettings(), "model", engine)
    assert args[args.index("--omp-threads-bind") + 1] == "0-1"
    assert args[args.index("--kv-cache-gib") + 1] == "0.75"


def test_serve_gives_every_worker_its_step_budget_and_leaves_the_engines_default_at_0():
    engine = plan_topology("1u", cores=[0, 1], gpus=0, kv_cache_gib=0.5).engines[0]
    args = worker_args(PoolSettings(step_tokens=1024), OrchestratorSettings(), "model", engine)
    assert args[args.index("--step-tokens") + 1] == "1024"
    assert "--step-tokens" not in worker_args(PoolSettings(), OrchestratorSettings(), "model", engine)
    with pytest.raises(ValueError, match="step_tokens"):
        PoolSettings(step_tokens=-1)


def test_engines_on_gpus_are_not_bound_to_cores():
    engine = plan_topology("1u", cores=[0, 1], gpus=1, kv_cache_gib=0.5).engines[0]
    assert "--omp-threads-bind" not in worker_args(PoolSettings(), OrchestratorSettings(), "model", engine)


def test_workers_speak_under_the_orchestrators_keys():
    engine = plan_topology("1u", cores=[0, 1], gpus=0, kv_cache_gib=0.5).engines[0]
    keyed = worker_args(PoolSettings(), OrchestratorSettings(cluster_keys="/keys", transfer_encryption="off"),
                        "model", engine)
    assert keyed[keyed.index("--cluster-keys") + 1] == "/keys" and "--insecure-no-auth" not in keyed
    assert keyed[keyed.index("--transfer-encryption") + 1] == "off"
    insecure = worker_args(PoolSettings(), OrchestratorSettings(insecure_no_auth=True), "model", engine)
    assert "--insecure-no-auth" in insecure and "--cluster-keys" not in insecure


def test_serve_gives_its_workers_the_trace_collector_and_none_without_one():
    engine = plan_topology("1u", cores=[0, 1], gpus=0, kv_cache_gib=0.5).engines[0]
    traced = worker_args(PoolSettings(), OrchestratorSettings(otlp_endpoint="http://127.0.0.1:4317",
                                                              otlp_protocol="grpc"), "model", engine)
    assert traced[traced.index("--otlp-endpoint") + 1] == "http://127.0.0.1:4317"
    assert traced[traced.index("--otlp-protocol") + 1] == "grpc"
    untraced = worker_args(PoolSettings(), OrchestratorSettings(), "model", engine)
    assert "--otlp-endpoint" not in untraced and "--otlp-protocol" not in untraced
