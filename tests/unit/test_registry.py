"""WorkerRegistry: who is admitted, when a worker counts as new or restarted, and when
a silent worker is dropped. Pure: heartbeats in, verdicts and views out, ``now`` given."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from foundation import wire
from orchestrator.registry import Verdict, WorkerRegistry, WorkerView

FP = "fp-orchestrator-0001"
TIMEOUT = 5.0


def beat(worker_id: str = "w1", role: str = "prefill", incarnation: str = "inc-1", fingerprint: str = FP,
         rpc_address: str | None = None, running: int = 0, kv_events: str = "") -> wire.Heartbeat:
    return wire.Heartbeat(worker_id=worker_id, role=role, incarnation=incarnation,
                          rpc_address=rpc_address or f"tcp://{worker_id}.workers.test:9000",
                          load=wire.WorkerLoad(num_running=running, num_free_blocks=10, num_total_blocks=20),
                          sent_at=0.0, kv_events_address=kv_events, model_fingerprint=fingerprint)


@pytest.fixture
def registry() -> WorkerRegistry:
    return WorkerRegistry(FP, heartbeat_timeout=TIMEOUT)


def test_accepts_matching_fingerprint_and_records_a_view(registry):
    verdict = registry.observe(beat(running=3, kv_events="tcp://127.0.0.1:5555"), now=10.0)
    assert verdict == Verdict(accepted=True, reason="", is_new=True, replaced=None)
    view = registry.get("w1")
    assert isinstance(view, WorkerView)
    assert (view.worker_id, view.role, view.incarnation, view.last_seen) == ("w1", "prefill", "inc-1", 10.0)
    assert view.rpc_address == beat().rpc_address
    assert view.load.num_running == 3
    assert view.kv_events_address == "tcp://127.0.0.1:5555"
    assert registry.live() == [view]


@pytest.mark.parametrize("fingerprint, shown", [
    ("fp-other-model-9999", "fp-other-model-9999"),
    ("", "missing"),
])
def test_refuses_other_or_missing_fingerprint(registry, fingerprint, shown):
    verdict = registry.observe(beat(fingerprint=fingerprint), now=1.0)
    assert not verdict.accepted
    assert not verdict.is_new and verdict.replaced is None
    # The reason goes back to the sender: it says the model differs, never which one is wanted.
    assert "does not match" in verdict.reason and FP not in verdict.reason
    assert fingerprint not in verdict.reason or not fingerprint
    # The orchestrator's own log names both sides, so an operator can see which release is which.
    assert shown in verdict.detail and FP in verdict.detail
    assert registry.get("w1") is None
    assert registry.live() == []


def test_refused_heartbeat_does_not_disturb_a_registered_worker(registry):
    registry.observe(beat(incarnation="good"), now=1.0)
    assert not registry.observe(beat(incarnation="bad", fingerprint="fp-x"), now=2.0).accepted
    view = registry.get("w1")
    assert view.incarnation == "good" and view.last_seen == 1.0


@pytest.mark.parametrize("role", ["router", "", "Prefill", "decoder"])
def test_refuses_unknown_role(registry, role):
    verdict = registry.observe(beat(role=role), now=1.0)
    assert not verdict.accepted
    assert repr(role) in verdict.reason
    assert registry.live() == []


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_accepts_known_roles(registry, role):
    assert registry.observe(beat(role=role), now=1.0).accepted
    assert [w.role for w in registry.live()] == [role]


def test_same_incarnation_is_not_new_and_refreshes(registry):
    assert registry.observe(beat(running=0), now=1.0).is_new
    verdict = registry.observe(beat(running=7), now=3.5)
    assert verdict == Verdict(accepted=True)
    assert not verdict.is_new and verdict.replaced is None
    view = registry.get("w1")
    assert view.last_seen == 3.5
    assert view.load.num_running == 7
    assert len(registry.live()) == 1


def test_new_incarnation_replaces_the_old_view(registry):
    registry.observe(beat(incarnation="inc-1", rpc_address="tcp://a:1"), now=1.0)
    old = registry.get("w1")
    verdict = registry.observe(beat(incarnation="inc-2", rpc_address="tcp://a:2"), now=2.0)
    assert verdict.accepted and verdict.is_new
    assert verdict.replaced == old
    assert verdict.replaced.incarnation == "inc-1"
    current = registry.get("w1")
    assert current.incarnation == "inc-2" and current.rpc_address == "tcp://a:2"
    assert len(registry.live()) == 1
    # And the next beat of the new incarnation is routine again.
    assert registry.observe(beat(incarnation="inc-2", rpc_address="tcp://a:2"), now=3.0) == Verdict(True)


def test_distinct_workers_are_independent(registry):
    assert registry.observe(beat("p1", "prefill"), now=1.0).is_new
    assert registry.observe(beat("d1", "decode"), now=1.0).is_new
    assert registry.observe(beat("p1", "prefill"), now=2.0).replaced is None
    assert {w.worker_id for w in registry.live()} == {"p1", "d1"}


def test_expire_removes_only_workers_silent_longer_than_the_timeout(registry):
    registry.observe(beat("old"), now=0.0)
    registry.observe(beat("edge"), now=5.0)
    registry.observe(beat("fresh"), now=9.0)
    # At now=10: "old" silent for 10 s (> 5), "edge" exactly 5 s (not longer), "fresh" 1 s.
    dead = registry.expire(now=10.0)
    assert [w.worker_id for w in dead] == ["old"]
    assert dead[0].last_seen == 0.0
    assert {w.worker_id for w in registry.live()} == {"edge", "fresh"}
    assert registry.get("old") is None
    # Expiring again at the same time finds nothing more.
    assert registry.expire(now=10.0) == []
    dead = registry.expire(now=10.5)
    assert [w.worker_id for w in dead] == ["edge"]
    assert [w.worker_id for w in registry.live()] == ["fresh"]


def test_a_heartbeat_keeps_a_worker_alive(registry):
    registry.observe(beat(), now=0.0)
    registry.observe(beat(), now=4.0)
    assert registry.expire(now=8.0) == []
    assert [w.worker_id for w in registry.expire(now=9.5)] == ["w1"]


def test_expired_worker_coming_back_is_new_again(registry):
    registry.observe(beat(), now=0.0)
    registry.expire(now=100.0)
    verdict = registry.observe(beat(), now=101.0)
    assert verdict.accepted and verdict.is_new and verdict.replaced is None


def test_live_filters_by_role(registry):
    for worker_id, role in [("p1", "prefill"), ("d1", "decode"), ("p2", "prefill"), ("d2", "decode"),
                            ("d3", "decode")]:
        registry.observe(beat(worker_id, role), now=1.0)
    assert sorted(w.worker_id for w in registry.live("prefill")) == ["p1", "p2"]
    assert sorted(w.worker_id for w in registry.live("decode")) == ["d1", "d2", "d3"]
    assert len(registry.live()) == 5
    assert len(registry.live(None)) == 5
    assert registry.live("router") == []


def test_remove(registry):
    registry.observe(beat("p1"), now=1.0)
    view = registry.get("p1")
    assert registry.remove("p1") == view
    assert registry.remove("p1") is None
    assert registry.live() == []


def test_views_are_immutable(registry):
    registry.observe(beat(), now=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        registry.get("w1").role = "decode"  # type: ignore[misc]


def test_the_cores_a_worker_computes_on_are_kept_for_the_planner(registry):
    cores = wire.CoreBinding(machine="boot-a", cores=(1,))
    registry.observe(msgspec.structs.replace(beat("p0"), cores=cores), now=0.0)
    registry.observe(beat("p1"), now=0.0)
    assert registry.get("p0").cores == cores
    assert registry.get("p1").cores is None


@pytest.mark.parametrize("field, value, named", [
    ("rpc_address", "garbage", "rpc_address"),
    ("rpc_address", "tcp://127.0.0.1:0", "port"),
    ("rpc_address", "tcp://*:5555", "host"),
    ("rpc_address", "tcp://0.0.0.0:5555", "wildcard"),
    ("rpc_address", "tcp://10.0.0.1;10.0.0.2:5555", "host"),
    ("rpc_address", "tcp://h:" + "9" * 300, "longer than"),
    ("kv_events_address", "udp://h:5556", "kv_events_address"),
    ("transfer_address", "ipc://relative.sock", "ipc path"),
    ("worker_id", "", "worker_id"),
    ("worker_id", "w" * 129, "worker_id"),
    ("worker_id", "w1\nFAKE LOG LINE", "printable"),
    ("incarnation", "inc 1", "incarnation"),
])
def test_refuses_a_malformed_heartbeat_and_registers_nothing(registry, field, value, named):
    verdict = registry.observe(msgspec.structs.replace(beat(), **{field: value}), now=1.0)
    assert not verdict.accepted and named in verdict.reason
    assert registry.live() == []


@pytest.mark.parametrize("load", [wire.WorkerLoad(num_free_blocks=-1), wire.WorkerLoad(head_prompt_age=float("nan")),
                                  wire.WorkerLoad(queued_prefill={"r": -5})])
def test_refuses_a_nonsensical_load(registry, load):
    assert not registry.observe(msgspec.structs.replace(beat(), load=load), now=1.0).accepted


def test_refuses_a_nonsensical_probe_or_core_binding(registry):
    assert not registry.observe(msgspec.structs.replace(
        beat(), prefill_probe=wire.PrefillProbe(new_tokens=8, seconds=float("inf"))), now=1.0).accepted
    assert not registry.observe(msgspec.structs.replace(
        beat(), cores=wire.CoreBinding(machine="boot-a", cores=(-1,))), now=1.0).accepted


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5555", "tcp://worker-3.pool.svc:20001", "tcp://[::1]:7001",
                                     "ipc:///tmp/kvroute/worker.sock"])
def test_accepts_every_address_form_workers_advertise(registry, address):
    assert registry.observe(beat(rpc_address=address), now=1.0).accepted


def test_a_full_fleet_refuses_new_ids_and_keeps_beating_the_registered_ones():
    registry = WorkerRegistry(FP, heartbeat_timeout=TIMEOUT, max_workers=2)
    assert registry.observe(beat("w1"), now=1.0).accepted and registry.observe(beat("w2"), now=1.0).accepted
    refused = registry.observe(beat("w3"), now=2.0)
    assert not refused.accepted and "full" in refused.reason
    assert registry.observe(beat("w1"), now=2.0).accepted  # a registered worker still beats
    registry.expire(now=1.0 + TIMEOUT + 0.1)  # w2 went silent: room for one more
    assert registry.observe(beat("w3"), now=7.0).accepted
