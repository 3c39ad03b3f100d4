"""The equal-resources rules every peer starts under, and how a budget is split among engines.

Every system gets the same model (SmolLM2-135M-Instruct as kvroute resolves it:
``foundation.model_prep.resolve_model``), the same dtype (kvroute's ``auto`` resolved for this
machine: ``worker.dtype``), 32-token KV blocks, prefix caching, the same context length and
the same TOTAL KV memory and cores. A system of N engines gives each 1/N of the KV bytes and
its own share of the cores; a single engine gets all of both.

Pure: the caller resolves model and dtype (``resolve``) and passes them in.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.topology import cpu_list, usable_cores
from worker.block_size import CPU_BLOCK_SIZE

SERVED_MODEL = "SmolLM2-135M-Instruct"
GIB = 2**30


@dataclass(frozen=True)
class Resources:
    """What every peer gets, in all: ``model`` is the folder (or hub id) vLLM loads."""

    model: str
    dtype: str
    total_kv_gib: float
    max_model_len: int
    cores: tuple[int, ...]
    block_size: int = CPU_BLOCK_SIZE
    served_model: str = SERVED_MODEL

    def __post_init__(self):
        if self.total_kv_gib <= 0 or self.max_model_len < 1 or not self.cores:
            raise ValueError("need a positive KV budget, a context length and at least one core")

    @property
    def total_kv_bytes(self) -> int:
        return int(self.total_kv_gib * GIB)

    def kv_bytes_each(self, engines: int) -> int:
        """Each of ``engines`` engines' share of the KV budget, in bytes (rounded down)."""
        return self.total_kv_bytes // engines

    def record(self) -> dict:
        """For results.json."""
        return {"model": self.model, "served_model": self.served_model, "dtype": self.dtype,
                "block_size": self.block_size, "total_kv_gib": self.total_kv_gib,
                "max_model_len": self.max_model_len, "cores": cpu_list(self.cores), "prefix_caching": True}


def resolve(dtype: str, total_kv_gib: float, max_model_len: int, model: str | None = None) -> Resources:
    """The resources of this machine: kvroute's model folder (prepared on first use) and dtype."""
    from foundation.model_prep import resolve_model
    from worker.dtype import resolve_here

    return Resources(model=resolve_model(model, progress=True), dtype=resolve_here(dtype), total_kv_gib=total_kv_gib,
                     max_model_len=max_model_len, cores=tuple(usable_cores()))
