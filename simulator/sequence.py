"""A request as one simulated engine holds it, and what one engine step schedules and yields.

Single writer: the ``Engine`` that holds the request (the loop only reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from foundation.identity import BlockHash
from orchestrator.tier_holdings import TierRun


class RequestState(str, Enum):
    WAITING = "waiting"
    PULLING = "pulling"  # blocks allocated, remote KV on its way
    READY = "ready"  # remote KV landed, to be admitted
    LOADING = "loading"  # blocks allocated, the node store's blocks on their way
    LOADED = "loaded"  # the node store's blocks landed, the rest of the prompt to compute
    RUNNING = "running"
    FINISHED = "finished"


def ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


@dataclass(eq=False)
class EngineRequest:
    """A request as one engine holds it; the KV of ``num_computed`` of its tokens exists."""

    request_id: str
    token_ids: list[int]  # the prompt
    block_keys: list[BlockHash]  # chained hashes of the prompt's full blocks
    max_tokens: int
    num_output: int = 0  # tokens sampled so far (a remote request starts with the prefill worker's)
    remote: bool = False
    state: RequestState = RequestState.WAITING
    num_computed: int = 0
    blocks: list[BlockHash | None] = field(default_factory=list)  # block table: key once cached
    num_registered: int = 0  # leading prompt blocks already cached or tried
    cached_tokens: int | None = None  # prefix-cache hit at first admission
    tier_tokens: int = 0  # loaded from the node store at first admission (vLLM counts both as cached)
    tier_disk_tokens: int = 0  # of ``tier_tokens``, from its disk tier
    # Prompt blocks before it came from the engine's cache, the node store or a pull at its
    # first admission: the node store is written the full blocks from here on when it ends.
    first_computed_block: int | None = None
    awaiting_output: bool = True  # no output yet: counted in the engine's queued prefill tokens
    hold_blocks: bool = False  # a DISAGG prefill: the connector holds its blocks for the pull
    submitted_at: float = 0.0  # when its engine accepted it
    # A request with a pull source (a DISAGG consumer) never looks in the node store, even
    # when a failed pull or a preemption has it recompute: ``remote`` as it was submitted.
    pull_source: bool = field(init=False)

    def __post_init__(self):
        self.pull_source = self.remote

    @property
    def num_prompt(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt + self.num_output

    @property
    def steps_left(self) -> int:
        return self.max_tokens - self.num_output


@dataclass
class Admission:
    """What one step schedules: (request, new tokens) in batch order, and pulls to start."""

    work: list[tuple[EngineRequest, int]] = field(default_factory=list)
    pulls: list[tuple[EngineRequest, int]] = field(default_factory=list)  # request, blocks to move
    loads: list[tuple[EngineRequest, TierRun]] = field(default_factory=list)  # request, node-store blocks to load
    preempted: list[EngineRequest] = field(default_factory=list)
    admitted: list[EngineRequest] = field(default_factory=list)  # started running in this step
    repeat: int = 1  # identical decode-only steps this schedule stands for

    def cut(self, steps: int) -> None:
        """Stop a decode run after ``steps`` steps."""
        self.repeat = max(1, min(self.repeat, steps))

    def prefill_chunks(self) -> list[tuple[int, int]]:
        return [(new, request.num_computed) for request, new in self.work if not is_decode(request, new)]

    def num_decodes(self) -> int:
        return sum(1 for request, new in self.work if is_decode(request, new))

    @property
    def decodes_only(self) -> bool:
        return bool(self.work) and not self.pulls and not self.loads and not self.preempted and not self.admitted \
            and all(is_decode(request, new) for request, new in self.work)


def is_decode(request: EngineRequest, new: int) -> bool:
    """One token that catches the request up: a decode (or a prompt's very last token)."""
    return new == 1 and request.num_computed == request.num_tokens - 1


@dataclass(frozen=True)
class Produced:
    """Tokens one request got in a step (run): ``count`` of them, one per step from ``first_at``."""

    request: EngineRequest
    count: int
    first_at: float
    step_seconds: float

    def token_at(self, position: int) -> float:
        return self.first_at + position * self.step_seconds

    @property
    def last_at(self) -> float:
        return self.token_at(self.count - 1)
