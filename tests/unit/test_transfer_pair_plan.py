"""What each backend of ``kvroute bench transfer``'s pairs is held against, and how a pair's
processes are set up for nixl between network namespaces."""

from __future__ import annotations

import os

import pytest

from kvroute.bench.transfer_pair import PairEnd, PairPlan


def plan(**overrides) -> PairPlan:
    return PairPlan(backends=("zmq-tcp", "zmq-ipc", "gloo", "nixl"), frame_sizes=(1024,), num_frames=2, **overrides)


def test_each_backend_is_held_against_its_own_raw_transport():
    baselines = {backend: plan().baseline(backend) for backend in plan().backends}
    assert baselines == {"zmq-tcp": "raw pyzmq tcp", "zmq-ipc": "raw pyzmq ipc", "gloo": "raw torch.distributed",
                         "nixl": "raw pyzmq ipc"}
    assert plan().raw_zmq_transport("gloo") is None


def test_nixl_on_tcp_is_held_against_raw_pyzmq_tcp():
    assert plan(nixl_ucx_tls="tcp").raw_zmq_transport("nixl") == "tcp"
    assert plan(nixl_ucx_tls="tcp").baseline("nixl") == "raw pyzmq tcp"
    assert plan(nixl_ucx_tls="tcp").baseline("zmq-ipc") == "raw pyzmq ipc"


@pytest.fixture
def environment(monkeypatch):
    monkeypatch.setattr(PairPlan, "configure_security", lambda self: None)  # keeps this process's keys
    for name in ("UCX_TLS", "UCX_NET_DEVICES"):
        monkeypatch.setenv(name, "")  # so that the undo removes what the test's ``enter`` sets
        monkeypatch.delenv(name)
    return os.environ


def test_a_process_of_a_nixl_tcp_pair_gets_ucx_on_its_own_device(environment):
    plan(nixl_ucx_tls="tcp").enter(PairEnd(device="veth9s"))
    assert (environment["UCX_TLS"], environment["UCX_NET_DEVICES"]) == ("tcp", "veth9s")


def test_a_pair_on_loopback_leaves_ucx_to_choose(environment):
    plan().enter(PairEnd())
    assert "UCX_TLS" not in environment and "UCX_NET_DEVICES" not in environment
