"""Workers' start-up prefill timings, fed to the cost model as they register.

A fleet listener: each worker times one cold prefill before it serves
(``worker.prefill_probe``) and reports it in its heartbeats. Taken as one
observation of its role, it sets the order of magnitude of the prefill estimates
(``PrefillCalibrator``'s scaled defaults) before any request has been timed, so the
first requests of a fresh cluster are not placed as if prefill cost what it costs on
the machine the defaults came from.
"""

from __future__ import annotations

import logging

from orchestrator.planner.calibration import Calibration
from orchestrator.registry import WorkerView

logger = logging.getLogger("kvroute.orchestrator.startup_calibration")


class StartupCalibration:
    def __init__(self, calibration: Calibration):
        self.calibration = calibration

    def worker_up(self, worker: WorkerView, client=None) -> None:
        probe = worker.prefill_probe
        if probe is None or probe.new_tokens <= 0 or probe.seconds <= 0:
            return
        self.calibration.observe_prefill(worker.role, probe.new_tokens, 0, probe.seconds)
        logger.info("%s prefilled %d tokens in %.3f s at start-up", worker.worker_id, probe.new_tokens,
                    probe.seconds)

    def worker_down(self, worker_id: str) -> None:
        """Its timing stays: it describes the hardware, which a restart does not change."""

    def worker_left(self, worker_id: str) -> None:
        """Its role's timings stay; its own speed and links go with it."""
        self.calibration.forget_worker(worker_id)
