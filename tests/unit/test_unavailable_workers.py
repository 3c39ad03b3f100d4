"""The status page's workers out of rotation: a heartbeating worker left out of the live and
draining lists is shown with the fault that took it out (a broken RPC connection, or its
circuit breaker open or probing); those in rotation or draining are not repeated."""

from __future__ import annotations

from types import SimpleNamespace

from foundation import wire
from orchestrator.admin import describe_unavailable
from orchestrator.circuit_breaker import BreakerSettings, CircuitBreakers
from orchestrator.registry import WorkerRegistry

SETTINGS = BreakerSettings(failure_threshold=1, cooldown_seconds=10.0)


class StubFleet:
    """What ``describe_unavailable`` reads of ``Fleet``, with its rule for who is live: reachable,
    not draining, and let through by the breaker."""

    def __init__(self):
        self.registry = WorkerRegistry("m", heartbeat_timeout=10.0)
        self.breakers = CircuitBreakers(SETTINGS)
        self.clients: dict[str, SimpleNamespace] = {}
        self.now = 0.0

    def register(self, worker_id: str, role: str, draining: bool = False, reachable: bool = True) -> None:
        beat = wire.Heartbeat(worker_id=worker_id, role=role, incarnation="i", rpc_address=f"tcp://{worker_id}:1",
                              load=wire.WorkerLoad(), sent_at=0.0, model_fingerprint="m", draining=draining)
        assert self.registry.observe(beat, now=0.0).accepted
        self.clients[worker_id] = SimpleNamespace(connection_lost=not reachable)

    def client(self, worker_id: str):
        return self.clients.get(worker_id)

    def live(self, role: str):
        return [w for w in self.registry.live(role) if not w.draining and not self.clients[w.worker_id].connection_lost
                and self.breakers.allows(w.worker_id, self.now)]

    def draining(self, role: str):
        return [w for w in self.registry.live(role) if w.draining and not self.clients[w.worker_id].connection_lost]


def test_each_worker_out_of_rotation_is_shown_with_its_fault():
    fleet = StubFleet()
    fleet.register("prefill-ok", "prefill")
    fleet.register("decode-draining", "decode", draining=True)
    fleet.register("prefill-lost", "prefill", reachable=False)
    fleet.register("decode-failing", "decode")
    fleet.breakers.failed("decode-failing", 5.0)  # threshold 1: open until 15 s
    fleet.register("unified-probing", "unified")
    fleet.breakers.failed("unified-probing", 0.0)
    fleet.now = 11.0  # past the cool-down: half-open, and its probe is under way
    fleet.breakers.dispatched("unified-probing", fleet.now)
    shown = {w["worker_id"]: (w["role"], w["reason"]) for w in describe_unavailable(fleet, fleet.now)}
    assert shown == {"prefill-lost": ("prefill", "unreachable"), "decode-failing": ("decode", "breaker open"),
                     "unified-probing": ("unified", "breaker half-open, probing")}


def test_a_healthy_fleet_has_nobody_out_of_rotation():
    fleet = StubFleet()
    fleet.register("prefill-0", "prefill")
    fleet.register("decode-0", "decode", draining=True)
    assert describe_unavailable(fleet, 0.0) == []
