"""The shape of ``kvroute serve``'s pool: how many engines, of which roles, on which cores,
with which KV budgets.

A topology is written as counts and roles: ``1u`` (one unified engine), ``2u``, ``2p1d``
(two prefill workers, one decode worker), ``1p1d2u``. ``auto`` picks one from the machine:

* on a machine with GPUs, one unified engine per GPU;
* on CPUs, one unified engine per ``cores_per_engine`` cores (default 8), at least one,
  each bound to cores of its own.

Why unified engines by default: on 2 cores (SmolLM2-135M, float32, 0.75 GiB of KV in all),
one engine on both cores served a repository-assistant replay at TTFT P50 0.088 s, where
two engines on a core each behind a cache-aware router took 0.165 s and a 2-prefill +
1-decode split 0.132 s (docs/topology.md): one engine computes each prompt with all the
cores and keeps every cached prefix in one cache. Splitting prefill from decode pays only
where prefills stall running decodes enough to break a per-token target; ``2p1d`` and
mixed shapes stay available for that. The cores-per-engine default is not yet measured
beyond 2 cores; ``--cores-per-engine`` overrides it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from foundation.wire import ROLES

AUTO = "auto"
DEFAULT_CORES_PER_ENGINE = 8
ROLE_LETTERS = {"p": "prefill", "d": "decode", "u": "unified"}
_TERM = re.compile(r"(\d+)([pdu])")


class TopologyError(ValueError):
    pass


@dataclass(frozen=True)
class Engine:
    role: str
    cores: str  # for --omp-threads-bind, e.g. "0-3" or "2"; "" on a GPU
    gpu: int | None  # the GPU it computes on (CUDA_VISIBLE_DEVICES), None on CPUs
    kv_cache_gib: float


@dataclass(frozen=True)
class Topology:
    spec: str  # e.g. "2p1d", as parsed or as ``auto`` chose it
    engines: tuple[Engine, ...]
    reason: str  # why this shape: the rule auto applied, or "given"

    def count(self, role: str) -> int:
        return sum(engine.role == role for engine in self.engines)

    def describe(self) -> dict:
        """What ``/admin/workers`` shows and the log says."""
        return {"spec": self.spec, "reason": self.reason,
                "engines": [{"role": e.role, "cores": e.cores, "gpu": e.gpu, "kv_cache_gib": e.kv_cache_gib}
                            for e in self.engines]}


def parse_spec(spec: str) -> dict[str, int]:
    """Worker counts per role of a spec such as ``2p1d``; a clear error for anything else."""
    text = spec.strip().lower()
    if not text or _TERM.sub("", text):
        raise TopologyError(f"topology {spec!r} is not 'auto' nor counts and roles such as 1u, 2u, 2p1d or "
                            f"1p1d1u (p: prefill, d: decode, u: unified)")
    counts = dict.fromkeys(ROLES, 0)
    for number, letter in _TERM.findall(text):
        counts[ROLE_LETTERS[letter]] += int(number)
    if sum(counts.values()) < 1:
        raise TopologyError(f"topology {spec!r} has no workers")
    if not counts["unified"] and not (counts["prefill"] and counts["decode"]):
        raise TopologyError(f"topology {spec!r} cannot serve: it needs a unified worker, or prefill and "
                            f"decode workers both")
    return counts


def spec_of(counts: dict[str, int]) -> str:
    return "".join(f"{counts[role]}{letter}" for letter, role in ROLE_LETTERS.items() if counts.get(role))


def cpu_list(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``: how --omp-threads-bind takes a set of cores."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def split_cores(cores: list[int], engines: int) -> list[str]:
    """Each engine's cores out of ``cores``: groups as even as the count allows while there
    are at least as many cores as engines; past that, engine i shares the (i mod n)-th core."""
    if engines > len(cores):
        return [str(cores[i % len(cores)]) for i in range(engines)]
    bounds = [round(i * len(cores) / engines) for i in range(engines + 1)]
    return [cpu_list(cores[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]


def auto_counts(cpu_cores: int, gpus: int, cores_per_engine: int) -> tuple[dict[str, int], str]:
    """What ``auto`` picks; see the module's docstring for why."""
    if gpus:
        return {"unified": gpus}, f"{gpus} GPU(s): one unified engine per GPU"
    engines = max(1, cpu_cores // cores_per_engine)
    return {"unified": engines}, (f"{cpu_cores} CPU core(s), no GPU: one unified engine per {cores_per_engine} "
                                  f"cores, at least one ({engines})")


def plan_topology(spec: str, *, cores: list[int], gpus: int, kv_cache_gib: float, total_kv_gib: float = 0.0,
                  cores_per_engine: int = DEFAULT_CORES_PER_ENGINE) -> Topology:
    """The engines to start for ``spec`` on a machine with ``cores`` (the CPU ids this process
    may use) and ``gpus``. ``total_kv_gib`` (when positive) is split evenly between the
    engines; otherwise each gets ``kv_cache_gib``."""
    if not cores:
        raise TopologyError("no CPU cores to run engines on")
    if cores_per_engine < 1:
        raise TopologyError("cores_per_engine must be at least 1")
    if spec.strip().lower() == AUTO:
        counts, reason = auto_counts(len(cores), gpus, cores_per_engine)
    else:
        counts, reason = parse_spec(spec), "given"
    roles = [role for role in ("prefill", "decode", "unified") for _ in range(counts.get(role, 0))]
    kv = total_kv_gib / len(roles) if total_kv_gib > 0 else kv_cache_gib
    if gpus:
        engines = tuple(Engine(role, "", i % gpus, kv) for i, role in enumerate(roles))
    else:
        engines = tuple(Engine(role, bound, None, kv) for role, bound in zip(roles, split_cores(cores, len(roles))))
    return Topology(spec_of(counts), engines, reason)


def gpu_count() -> int:
    """GPUs ``nvidia-smi -L`` lists (0 without the tool or a driver), as deploy/start-pool.sh counts them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return 0
    try:
        listed = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0


def usable_cores() -> list[int]:
    """The CPU ids this process may run on (its affinity), not every core of the machine."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))
