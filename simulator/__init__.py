"""A discrete-event simulator of a kvroute cluster that drives the production planner.

Prefill, decode and unified workers (any topology of ``kvroute serve``) behave like vLLM
engines (``engine``: block prefix cache with LRU eviction, chunked prefill, continuous-
batching decode, KV capacity); KV moves between them over links (``links``), and with node
KV stores from a store per node (``node_store``); step and transfer times come from a calibration
(``calibration``, fitted from a real run by ``from_replay``), stretched where engines
share CPU cores (``cpu``). Every placement is made by the orchestrator's own policies,
from the same ``WorkerView``s and ``PrefixIndex`` the service builds (``fleet``, ``loop``).
``simulate()`` runs one policy over a trace or workload and returns per-request records
and a summary.
"""

from simulator.calibration import SimCalibration
from simulator.cpu import CpuSettings
from simulator.engine import EngineConfig
from simulator.node_store import TierSettings
from simulator.simulate import SimulationResult, SimulationSettings, simulate

__all__ = ["CpuSettings", "EngineConfig", "SimCalibration", "SimulationResult", "SimulationSettings", "TierSettings",
           "simulate"]
