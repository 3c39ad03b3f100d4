"""Frozen inputs and outputs of the planner. No clock, socket or global config inside.

The orchestrator builds these snapshots from the registry (load, capacity), its own
in-flight counts, and the index (how many leading prompt blocks a worker holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class PlanKind(str, Enum):
    LOCAL = "local"  # the decode worker prefills the prompt itself (its own cached prefix helps)
    DISAGG = "disagg"  # a prefill worker prefills; the decode worker pulls the blocks it lacks
    # A unified worker pulls the prompt's leading blocks from another worker that holds them,
    # computes the rest itself and decodes: a prefix reused across replicas, not recomputed.
    PULL = "pull"


UNIFIED = "unified"  # the role of a worker whose one engine prefills and decodes: it is in both pools


@dataclass(frozen=True)
class DecodeStream:
    """One request decoding on a worker, as the orchestrator relays it
    (``orchestrator.decode_streams``): how it has fared there and what it is promised."""

    tpot_target: float  # seconds a token it should average; 0: no target
    decoded_tokens: int  # tokens since its first one on this worker: its gaps so far
    decode_seconds: float  # from its first token on this worker to its latest
    tokens_left: int  # at most, by its max_tokens


@dataclass(frozen=True)
class WorkerView:
    """One worker as the planner sees it at decision time."""

    worker_id: str
    role: str  # "prefill" | "decode" | "unified"
    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    bytes_per_block: int
    in_flight: int = 0  # requests this orchestrator sent and has not seen finish
    cached_blocks: int = 0  # leading blocks of this request's prompt resident on the worker, or claimed there
    # Of ``cached_blocks``, how many a request sent now would reuse (``orchestrator.followers``:
    # a prefix still queued behind another prompt is mostly recomputed); None: all of them.
    followable_blocks: int | None = None
    resident_blocks: int = 0  # blocks of any prompt resident on the worker (the index's count)
    # Busy engines bound to one of this worker's CPU cores (``orchestrator.core_sharing``):
    # while they compute, this one computes slower.
    core_neighbours: tuple[WorkerView, ...] = ()
    # Tokens each queued prompt still has to compute (None: the worker reports only the
    # total), and the most tokens its engine gives one prompt a step (0: prompts take
    # whole steps in turn). With both, the queue is priced as the engine shares it.
    queued_prompts: tuple[int, ...] | None = None
    prompt_step_cap: int = 0
    # Seconds the oldest of ``queued_prompts`` has computed without its listed tokens
    # changing: the part of it already done.
    head_prompt_elapsed: float = 0.0
    # Prompt blocks after ``cached_blocks`` that the worker's node KV store holds without a
    # gap, by tier (``orchestrator.tier_holdings``): a prefill there loads them instead of
    # computing them.
    tier_host_blocks: int = 0
    tier_disk_blocks: int = 0
    # The streams this orchestrator relays from the worker that have had a token from it:
    # what a prefill there would stall, and their TPOT targets.
    decoding: tuple[DecodeStream, ...] = ()

    @property
    def reusable_blocks(self) -> int:
        """Leading prompt blocks a prefill sent here now would skip."""
        return self.cached_blocks if self.followable_blocks is None else min(self.followable_blocks,
                                                                             self.cached_blocks)

    @property
    def reachable_blocks(self) -> int:
        """Leading prompt blocks a prefill here starts from: its engine's and, after them, its
        node store's run. What candidates are pruned by (``candidates.match_key``)."""
        return self.cached_blocks + self.tier_host_blocks + self.tier_disk_blocks

    @property
    def cache_fill(self) -> float:
        """Share of the worker's KV cache that holds indexed blocks (0 when it reports none)."""
        return self.resident_blocks / self.num_total_blocks if self.num_total_blocks else 0.0


@dataclass(frozen=True)
class RequestView:
    request_id: str
    prompt_tokens: int
    expected_output_tokens: int
    block_size: int


@dataclass(frozen=True)
class Estimate:
    """Seconds unless named otherwise. ``ttft`` is what the client waits for token 1;
    ``gap`` is the hand-off between token 1 and token 2 (transfer + decode admission)."""

    queue_wait: float
    prefill: float
    transfer: float
    ttft: float
    gap: float
    reused_tokens: int
    transfer_bytes: int
    # Seconds charged for slowing others down: a LOCAL prefill stalls the decode worker's
    # running decodes (``stall``). Not part of this request's TTFT; planners add it when ranking.
    interference: float = 0.0
    # Seconds the queue and prefill take longer because busy engines share the prefilling
    # worker's CPU cores; part of ``ttft``.
    contention: float = 0.0
    # Seconds this prefill adds, in all, to the first tokens of the prompts already queued
    # on its worker (an engine sharing its steps between them). Not part of ``ttft``;
    # the cache-aware planner adds it when ranking, as it does ``interference``.
    queue_delay: float = 0.0
    # Of ``reused_tokens``, those loaded from the prefilling worker's node KV store, and the
    # seconds the load takes (part of ``ttft``).
    tier_tokens: int = 0
    tier_load: float = 0.0
    tier_disk_tokens: int = 0  # of ``tier_tokens``, those on the store's disk tier
    # Seconds the prefill stalls the decodes running on its worker, summed over them: what
    # ``interference`` charges for. The decision record holds it beside the stall measured.
    stall: float = 0.0
    # Seconds the plan's prefills push running streams past their TPOT targets, summed over
    # them, and the part of ``interference`` charged for that (those seconds count in full,
    # not at the interference weight).
    tpot_overrun: float = 0.0
    tpot_charge: float = 0.0


@dataclass(frozen=True)
class Plan:
    kind: PlanKind
    decode_worker: str
    prefill_worker: str | None  # None for LOCAL
    estimate: Estimate | None = None
    feasible: bool = True
    infeasible_reason: str = ""
    source_worker: str | None = None  # PULL: the worker lending the prompt's leading blocks
    lend_tokens: int = 0  # PULL: how many leading prompt tokens (whole blocks) it lends

    @property
    def workers(self) -> tuple[str, ...]:
        lender = self.lending_worker
        return (lender, self.decode_worker) if lender else (self.decode_worker,)

    @property
    def lending_worker(self) -> str | None:
        """The worker whose blocks the decode worker pulls: a DISAGG's prefill worker, a PULL's source."""
        return self.prefill_worker or self.source_worker

    @property
    def prefilling_worker(self) -> str:
        """The worker that computes the prompt's new tokens (the source of a PULL lends only)."""
        return self.prefill_worker or self.decode_worker


@dataclass(frozen=True)
class Decision:
    """The chosen plan, the alternatives considered (with their estimates), and why."""

    policy: str
    chosen: Plan | None
    alternatives: tuple[Plan, ...] = field(default_factory=tuple)
    reason: str = ""
