"""Start-up prefill probes: carried by heartbeats into the registry, fed to the cost model
when a worker registers, so the first requests are priced at this machine's speed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from foundation import wire
from orchestrator.planner.calibration import Calibration
from orchestrator.planner.cost_model import DEFAULT_PREFILL, prefill_seconds
from orchestrator.registry import WorkerRegistry
from orchestrator.startup_calibration import StartupCalibration

FP = "fp-1"


def beat(worker_id: str, role: str, probe: wire.PrefillProbe | None) -> wire.Heartbeat:
    return wire.Heartbeat(worker_id=worker_id, role=role, incarnation=f"inc-{worker_id}", rpc_address="tcp://x:1",
                          load=wire.WorkerLoad(), sent_at=0.0, model_fingerprint=FP, prefill_probe=probe)


def registered(registry: WorkerRegistry, worker_id: str, role: str, probe: wire.PrefillProbe | None):
    assert registry.observe(beat(worker_id, role, probe), now=1.0).is_new
    return registry.get(worker_id)


def test_the_registry_keeps_a_workers_probe():
    registry = WorkerRegistry(FP, heartbeat_timeout=5.0)
    probe = wire.PrefillProbe(new_tokens=128, seconds=0.9)
    assert registered(registry, "p0", "prefill", probe).prefill_probe == probe
    assert registered(registry, "p1", "prefill", None).prefill_probe is None
    decoded = wire.decode(wire.encode(beat("p2", "decode", probe)))
    assert decoded.prefill_probe == probe


def test_a_probe_scales_the_start_up_defaults_to_the_machine():
    """One probe 20x slower than the defaults predict: every estimate of that class is 20x
    the default's, before any request was timed."""
    registry, calibration = WorkerRegistry(FP, heartbeat_timeout=5.0), Calibration()
    default = prefill_seconds(calibration.calibrated_model(), 128, 0, "prefill")
    slow = wire.PrefillProbe(new_tokens=128, seconds=20 * default)
    StartupCalibration(calibration).worker_up(registered(registry, "p0", "prefill", slow))
    model = calibration.calibrated_model()
    for new, cached in ((128, 0), (1000, 0), (50, 900)):
        expected = 20 * prefill_seconds(replace(model, prefill_by_class={}, prefill=DEFAULT_PREFILL), new, cached)
        assert prefill_seconds(model, new, cached, "prefill") == pytest.approx(expected)
        assert prefill_seconds(model, new, cached, "decode") == pytest.approx(expected), "pooled: same machine"


def test_a_worker_without_a_usable_probe_changes_nothing():
    registry, calibration = WorkerRegistry(FP, heartbeat_timeout=5.0), Calibration()
    before = calibration.calibrated_model()
    listener = StartupCalibration(calibration)
    listener.worker_up(registered(registry, "p0", "prefill", None))
    listener.worker_up(registered(registry, "p1", "prefill", wire.PrefillProbe(new_tokens=0, seconds=1.0)))
    listener.worker_up(registered(registry, "d0", "decode", wire.PrefillProbe(new_tokens=128, seconds=0.0)))
    assert calibration.calibrated_model() == before
