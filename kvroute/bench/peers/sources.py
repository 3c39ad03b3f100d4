"""The workloads of ``kvroute bench peers``, each at a given request rate and size.

Every workload is the same seeded list of requests for every system, so the systems differ
only in how they serve it. ``rate`` is in requests per second for all four:

* ``repository-assistant``: long shared repository prefixes, short questions (16 tokens out);
* ``long-output``: ``prefix-repetition`` with 4 shared 512-token prefixes, 64-token questions
  and exactly 256 tokens out (the client sends ``ignore_eos``, so every answer has its
  ``max_tokens``): decode-heavy, where time per output token decides;
* ``conversation``: ``support-chat``, multi-turn conversations whose history grows; a
  conversation has 4 turns on average, and conversations start at the rate (about ``rate / 4``
  per second) that makes the first N turns arrive at ``rate``;
* ``trace``: the Mooncake trace (``kvroute.bench.paths.DEFAULT_TRACE``): every record of a
  seeded 2% of its prefix families, scaled as ``kvroute bench trace`` scales it (32-token
  blocks, a tenth of the outputs), its first N requests re-timed to arrive at ``rate``
  with the trace's own rhythm; token-id prompts to ``/v1/completions``. Its source notes the
  hit rate one shared cache that never evicts would reach on those requests.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

from kvroute.bench.oracle import oracle_requests, unlimited_reuse
from kvroute.bench.replay import ReplayItem
from kvroute.bench.replay_sources import WorkloadChoice, trace_item, workload_items
from worker.block_size import CPU_BLOCK_SIZE
from workloads.support_chat import SupportChatConfig
from workloads.trace import TraceRecord, TraceRequest, TraceScaling, read_trace, sample_families, scale_trace

WORKLOADS = ("repository-assistant", "long-output", "conversation", "trace")
LONG_OUTPUT_TOKENS = 256
LONG_OUTPUT_PREFIXES = 4
TRACE_FAMILY_FRACTION = 0.02
TRACE_OUTPUT_SCALE = 0.1
_CHAT = SupportChatConfig()
CONVERSATION_MEAN_TURNS = (_CHAT.turns_min + _CHAT.turns_max) / 2
CONVERSATION_TUNING_PASSES = 6


@dataclasses.dataclass(frozen=True)
class SourceSettings:
    requests: int
    seed: int = 0
    trace: Path | None = None
    max_model_len: int = 4096


def items(workload: str, rate: float, settings: SourceSettings) -> tuple[list[ReplayItem], dict]:
    """The requests of ``workload`` at ``rate`` requests/s, and where they came from (results.json)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    if rate <= 0:
        raise ValueError("rates must be positive")
    if workload == "trace":
        built, source = trace_workload(rate, settings)
    elif workload == "conversation":
        built, source = conversation_workload(rate, settings)
    else:
        name, choice = generator_choice(workload, rate, settings)
        built, source = workload_items(name, choice), {"generator": name, **dataclasses.asdict(choice)}
    return built, {**source, "offered_rate": offered_rate(built)}


def offered_rate(replay_items: list[ReplayItem]) -> float | None:
    """Requests per second over the schedule: (N − 1) / the last arrival."""
    last = max((item.arrival_seconds for item in replay_items), default=0.0)
    return (len(replay_items) - 1) / last if last > 0 else None


def conversation_workload(rate: float, settings: SourceSettings) -> tuple[list[ReplayItem], dict]:
    """support-chat with its conversation start rate tuned (a few seeded passes) so that the
    first N turns arrive at ``rate``: turns follow think times, so a short run has fewer
    conversations open at once than the steady state that ``rate / mean turns`` assumes."""
    name, choice = generator_choice("conversation", rate, settings)
    for _ in range(CONVERSATION_TUNING_PASSES):
        built = workload_items(name, choice)
        achieved = offered_rate(built)
        if achieved is None or abs(achieved / rate - 1) < 0.05:
            break
        choice = dataclasses.replace(choice, rate=choice.rate * rate / achieved)
    return built, {"generator": name, **dataclasses.asdict(choice)}


def generator_choice(workload: str, rate: float, settings: SourceSettings) -> tuple[str, WorkloadChoice]:
    """The ``workloads`` generator behind a chat workload, with its overrides."""
    n = settings.requests
    if workload == "repository-assistant":
        return workload, WorkloadChoice(requests=n, rate=rate, seed=settings.seed)
    if workload == "long-output":
        repetitions = math.ceil(n / LONG_OUTPUT_PREFIXES)
        options = (f"num_prefixes={LONG_OUTPUT_PREFIXES}", "prefix_tokens=512", "suffix_tokens=64",
                   f"output_tokens={LONG_OUTPUT_TOKENS}", f"repetitions_per_prefix={repetitions}")
        return "prefix-repetition", WorkloadChoice(requests=n, rate=rate, seed=settings.seed, options=options)
    # conversation: more conversations than n turns need (the first n turns in arrival order are
    # kept), started so that in the steady state turns arrive at rate (conversation_workload tunes it)
    conversations = 2 * math.ceil(n / CONVERSATION_MEAN_TURNS)
    return "support-chat", WorkloadChoice(requests=n, rate=rate / CONVERSATION_MEAN_TURNS, seed=settings.seed,
                                          options=(f"conversations={conversations}",))


@functools.lru_cache(maxsize=2)
def _records(path: Path) -> tuple[TraceRecord, ...]:
    return tuple(read_trace(path))


def trace_workload(rate: float, settings: SourceSettings) -> tuple[list[ReplayItem], dict]:
    if settings.trace is None:
        raise ValueError("the trace workload needs a trace file")
    scaling = TraceScaling(block_tokens=CPU_BLOCK_SIZE, output_scale=TRACE_OUTPUT_SCALE,
                           max_context_tokens=settings.max_model_len, seed=settings.seed)
    sample = scale_trace(sample_families(_records(Path(settings.trace)), TRACE_FAMILY_FRACTION, settings.seed),
                         scaling)
    requests = retimed(sample.requests[:settings.requests], rate)
    # What one shared cache that never evicts would reuse of these requests: the bound a
    # system's hit rate is judged by (kvroute.bench.oracle).
    bound = unlimited_reuse(oracle_requests(requests, CPU_BLOCK_SIZE), CPU_BLOCK_SIZE)
    source = {"trace": str(settings.trace), "family_fraction": TRACE_FAMILY_FRACTION,
              "scaling": dataclasses.asdict(scaling), "sampled": sample.kept, "dropped": sample.dropped,
              "replayed": len(requests), "unlimited_cache_hit_rate": bound.hit_rate}
    return [trace_item(request) for request in requests], source


def retimed(requests: list[TraceRequest], rate: float) -> list[TraceRequest]:
    """``requests`` from time 0, stretched or squeezed so that N of them span (N − 1) / ``rate``
    seconds with their gaps in proportion; evenly spaced if they all arrived at once."""
    if len(requests) < 2:
        return [dataclasses.replace(r, arrival_seconds=0.0) for r in requests]
    first, last = requests[0].arrival_seconds, requests[-1].arrival_seconds
    span = (len(requests) - 1) / rate
    if last <= first:
        return [dataclasses.replace(r, arrival_seconds=k / rate) for k, r in enumerate(requests)]
    factor = span / (last - first)
    return [dataclasses.replace(r, arrival_seconds=(r.arrival_seconds - first) * factor) for r in requests]


def requested_lengths(replay_items: list[ReplayItem]) -> dict[int, int]:
    """Each request's ``max_tokens``, to check that outputs had exactly that length."""
    return {item.index: item.payload().get("max_tokens") for item in replay_items}
