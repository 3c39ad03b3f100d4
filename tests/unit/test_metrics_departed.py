"""A worker that leaves the fleet takes its metric series with it at the next scrape, the
series of links it was an end of too; the workers that stay keep theirs."""

from __future__ import annotations

from prometheus_client import generate_latest

from foundation import wire
from orchestrator.circuit_breaker import BreakerSettings, CircuitBreakers
from orchestrator.index import PrefixIndex
from orchestrator.metrics import Metrics
from orchestrator.registry import WorkerRegistry


class RegisteredFleet:
    """What ``refresh_fleet`` reads: every registered worker is live."""

    def __init__(self):
        self.registry = WorkerRegistry("m", heartbeat_timeout=10.0)
        self.breakers = CircuitBreakers(BreakerSettings())

    def live(self, role: str):
        return self.registry.live(role)

    def draining(self, role: str):
        return []


def register(fleet: RegisteredFleet, worker_id: str, role: str) -> None:
    beat = wire.Heartbeat(worker_id=worker_id, role=role, incarnation="i", rpc_address=f"tcp://{worker_id}:1",
                          load=wire.WorkerLoad(), sent_at=0.0, model_fingerprint="m")
    assert fleet.registry.observe(beat, now=0.0).accepted


def exported(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_a_departed_workers_series_are_removed_and_the_others_kept():
    fleet, metrics, index = RegisteredFleet(), Metrics(), PrefixIndex()
    register(fleet, "prefill-a", "prefill")
    register(fleet, "decode-b", "decode")
    metrics.observe_transfer("prefill-a", "decode-b", 4096, 0.01)
    metrics.observe_misprediction("prefill-a")
    metrics.observe_claim_miss("decode-b")
    metrics.refresh_fleet(fleet, index)
    assert 'worker="prefill-a"' in exported(metrics) and 'source="prefill-a"' in exported(metrics)

    fleet.registry.remove("prefill-a")  # marked down
    metrics.refresh_fleet(fleet, index)
    text = exported(metrics)
    assert "prefill-a" not in text
    assert 'kvroute_claim_misses_total{worker="decode-b"} 1.0' in text
    assert 'kvroute_index_blocks{worker="decode-b"}' in text


def test_a_worker_that_comes_back_gets_fresh_series():
    fleet, metrics, index = RegisteredFleet(), Metrics(), PrefixIndex()
    register(fleet, "decode-b", "decode")
    metrics.observe_misprediction("decode-b")
    metrics.refresh_fleet(fleet, index)
    fleet.registry.remove("decode-b")
    metrics.refresh_fleet(fleet, index)
    register(fleet, "decode-b", "decode")
    metrics.observe_misprediction("decode-b")
    metrics.refresh_fleet(fleet, index)
    assert 'kvroute_index_mispredictions_total{worker="decode-b"} 1.0' in exported(metrics)
