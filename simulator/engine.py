"""One simulated vLLM engine: its scheduler, step by step, over a ``BlockPool``.

Like vLLM v1's scheduler, every step gets a token budget and spends it on

1. the **running** requests, in admission order: one token for each decoding request,
   the next prompt chunk for each prefilling one (chunked prefill). A request that needs
   a block when none is free preempts the most recently admitted running request (its
   blocks are released, it goes back to the head of the queue and is recomputed later,
   usually from its own cached prefix);
2. then, if nothing was preempted, the **waiting** requests in arrival order: a prefix-
   cache hit first (whole cached blocks, never the last prompt token), then a chunk of
   what is left. The first request that does not fit stops admission (head of line).

As in vLLM (``KVCacheManager.allocate_slots``), a chunk's full prompt blocks join the
prefix cache, and are reported stored, when the chunk is scheduled, not when the step
that computes them ends: a request admitted later, in the same step or after, hits them
(the forward pass writes each layer's new KV before any request attends to it).

A request whose prompt KV comes from a prefill worker (``remote``) is admitted by
allocating blocks for its prompt and the prefill worker's token, minus what the local
cache already holds; its pull then runs outside the engine (``Admission.pulls``), and
once ``pull_done`` it decodes like any other (after ``pull_failed`` it is prefilled
here). A request ends when it has ``max_tokens``.

With a node store (``tier``, ``simulator.node_store``), a request without a pull source
is asked about first, as kvroute's connector asks the store past the engine's own hit:
when the store holds the prompt's next blocks (never the last token's), the request is
admitted with blocks for its whole prompt, the store's blocks are loaded outside the
engine (``Admission.loads``), and once ``tier_loaded`` they join the prefix cache and
the request computes the rest. Allocating the whole prompt up front, as for a pull,
keeps a loaded request from waiting for blocks behind another. When a request ends,
the full prompt blocks it computed itself are written through (``take_saves``).

::

    submit ─▶ WAITING ─admit─▶ RUNNING (prefill chunks → decode tokens) ─▶ FINISHED
                 │  ▲  ▲              │
                 │  │  └─ preempted ──┘
      remote:    │  └─ pull_failed ─┐
                 ├─▶ PULLING ───────┴─pull_done─▶ READY ─admit─▶ RUNNING
      tier hit:  └─▶ LOADING ─tier_loaded─▶ LOADED ─admit─▶ RUNNING (the rest of the prompt)

**Decode runs.** A step that only decodes, and admitted nothing, is followed by the
same step until the first request finishes, since nothing can enter a step the engine
already could not take. Such steps are scheduled as one run of ``repeat`` identical
steps (fewer when the free blocks would not last), and ``Admission.cut`` shortens a run
when something new arrives: that is what keeps the simulator fast at 1,000 workers.
The state at every step boundary is the same as stepping one by one; in the middle of
a run the engine still shows the state at its start.

Single writer: the simulation loop, which calls ``schedule`` and then ``complete``
for each step, and ``submit`` / ``pull_done`` / ``tier_loaded`` between steps. The
engine only reads its node store; the loop performs the loads and writes it asks for.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from foundation.identity import BlockHash
from orchestrator.tier_holdings import NO_RUN, TierRun
from simulator.block_pool import BlockPool, publish_stored
from simulator.node_store import NodeStore
from simulator.sequence import Admission, EngineRequest, Produced, RequestState, ceil_div


@dataclass(frozen=True)
class EngineConfig:
    """vLLM-like limits. Defaults: vLLM's chunked-prefill budget and sequence cap, block
    size 16 (a multiple that divides the scaled trace's 64-token blocks), 4,096 blocks
    (64k tokens, ~1.4 GiB of SmolLM2 KV in bf16)."""

    num_blocks: int = 4096
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # vLLM's ``long_prefill_token_threshold``: most prompt tokens one request computes per
    # step while another request is running or waiting (alone, it takes the whole budget); 0: no cap.
    long_prefill_tokens: int = 0
    # Schedule identical decode-only steps as one run (see the module docstring). The
    # state at every step boundary is the same either way; False steps one by one.
    decode_runs: bool = True
    # A DISAGG prefill's blocks stay allocated until the end of the engine's next step, as
    # vLLM frees a KV connector's delayed blocks only once the worker reports them sent
    # (kvroute stages them to host memory meanwhile); an engine with nothing else to do
    # frees them at once (it steps idly until then). False: freed when the request ends.
    hold_sent_blocks: bool = False
    # A pulled prompt's blocks go first when the engine must evict, as kvroute's connector
    # orders them on decode workers (``transfer.connector_scheduler``); a block a local
    # request hits since keeps the plain LRU order. False: vLLM's plain LRU.
    evict_pulled_first: bool = False

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.long_prefill_tokens < 0:
            raise ValueError("long_prefill_tokens must not be negative")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (vLLM requires it: every "
                             "running sequence needs a token of each step's budget)")


class Engine:
    def __init__(self, config: EngineConfig, tier: NodeStore | None = None):
        self.config = config
        self.pool = BlockPool(config.num_blocks)
        self.tier = tier  # its node's store; None: no node tier
        self._saves: list[list[BlockHash]] = []  # blocks to write through, per request ended
        self.waiting: list[EngineRequest] = []
        self.running: list[EngineRequest] = []
        self.num_preemptions = 0
        self._held: list[list[BlockHash | None]] = []  # block tables of sent prefills (hold_sent_blocks)

    def queued_prefill_tokens(self) -> int:
        return sum(self.queued_prompts())

    def queued_prompts(self) -> tuple[int, ...]:
        """Prompt tokens each request with no output yet still has to compute, as a
        worker's heartbeat lists them (``worker.queued_prefill``): what its prefill
        has computed and what the cache already holds are done; a pulled prompt is no
        prefill work. The worker learns of a chunk's blocks from KV events published after
        the step that computes it, so a chunk in progress still counts here."""
        size = self.config.block_size
        left = [request.num_prompt - request.num_computed for request in prefilling(self.running)]
        left.extend(request.num_prompt - max(len(self._hit(request)) * size, request.num_computed)
                    for request in prefilling(self.waiting))
        return tuple(left)

    def queued_request_ids(self) -> tuple[str, ...]:
        """The requests ``queued_prompts`` lists, in its order (oldest first)."""
        return tuple(request.request_id for request in (*prefilling(self.running), *prefilling(self.waiting)))

    def oldest_queued_at(self) -> float | None:
        """When the first request ``queued_prompts`` lists was submitted (None: none)."""
        oldest = next(prefilling(self.running), None) or next(prefilling(self.waiting), None)
        return None if oldest is None else oldest.submitted_at

    # ------------------------------------------------------------ between steps

    def submit(self, request: EngineRequest) -> None:
        self.waiting.append(request)

    def pull_done(self, request: EngineRequest) -> None:
        """The remote prompt KV landed: its full blocks join the local prefix cache."""
        assert request.state is RequestState.PULLING, request.state
        request.num_computed = request.num_prompt
        request.state = RequestState.READY
        self._register_full_blocks(request, request.num_prompt, evict_first=self.config.evict_pulled_first)

    def pull_failed(self, request: EngineRequest) -> None:
        """The prefill worker refused the pull: kvroute's connector then recomputes the
        prompt here, from this engine's own cache. The request keeps its place in the queue."""
        assert request.state is RequestState.PULLING, request.state
        self._release(request)
        request.num_computed = request.num_registered = 0
        request.remote = False
        request.state = RequestState.WAITING

    def tier_loaded(self, request: EngineRequest, num_blocks: int) -> None:
        """The node store's ``num_blocks`` (after the hit) landed: they join the prefix
        cache, and the rest of the prompt is computed."""
        assert request.state is RequestState.LOADING, request.state
        request.num_computed = (request.num_registered + num_blocks) * self.config.block_size
        request.state = RequestState.LOADED
        self._register_full_blocks(request, request.num_computed)

    def take_saves(self) -> list[list[BlockHash]]:
        """The full prompt blocks each request that ended since the last call computed
        itself (none without a node store): what the connector writes through."""
        saves, self._saves = self._saves, []
        return saves

    @property
    def empty(self) -> bool:
        return not self.running and not self.waiting

    # ------------------------------------------------------------ scheduling

    def schedule(self) -> Admission:
        step = self._schedule()
        if self._held and not step.work and not step.pulls:
            self._free_held()  # an idle step: the worker reports the sends, vLLM frees their blocks
            step = self._schedule()
        return step

    def _schedule(self) -> Admission:
        step = Admission()
        cap = self.config.long_prefill_tokens if len(self.running) + len(self.waiting) > 1 else 0
        budget = self._schedule_running(step, self.config.max_num_batched_tokens, cap)
        if not step.preempted:
            self._schedule_waiting(step, budget, cap)
        if step.decodes_only and self.config.decode_runs:
            step.repeat = self._decode_run_length(step)
        return step

    def _schedule_running(self, step: Admission, budget: int, cap: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            new = capped(min(request.num_tokens - request.num_computed, budget), cap)
            if self._grow(request, request.num_computed + new, step):
                self._register_full_blocks(request, request.num_computed + new)
                step.work.append((request, new))
                budget -= new
                index += 1
            # else: preempted itself; everything after it is gone too
        return budget

    def _grow(self, request: EngineRequest, tokens: int, step: Admission) -> bool:
        """Blocks for ``tokens`` tokens of ``request``, preempting from the back as needed."""
        needed = ceil_div(tokens, self.config.block_size) - len(request.blocks)
        while needed > self.pool.num_free:
            victim = self.running.pop()
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                return False
        self._allocate(request, needed)
        return True

    def _schedule_waiting(self, step: Admission, budget: int, cap: int) -> None:
        """In queue order, until a request finds no blocks. Requests whose pulled or loaded
        KV has landed still go then: they hold their blocks already, and vLLM puts the requests
        it skipped while their KV was loading back at the head of its queue. (Waiting
        behind a prompt that cannot fit, with nothing running to free blocks, they would
        never run.)"""
        out_of_blocks = False
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if request.state is RequestState.PULLING:
                continue  # vLLM skips requests waiting for remote KV
            if request.state is RequestState.LOADING:
                continue  # as a pull: skipped while its blocks are on their way
            if request.state is RequestState.READY:
                new = 1  # blocks were allocated for the prompt and the prefill worker's token
            elif request.state is RequestState.LOADED:
                new = self._resume_prefill(request, budget, cap)  # its blocks were allocated for the load
            elif out_of_blocks:
                continue
            elif request.remote:
                out_of_blocks = not self._start_pull(request, step)
                continue
            else:
                hit_keys = self._hit(request)
                run = self._tier_run(request, len(hit_keys))
                if run.blocks:
                    out_of_blocks = not self._start_load(request, hit_keys, run, step)
                    continue
                new = self._start_prefill(request, hit_keys, budget, cap)
                if new is None:
                    out_of_blocks = True
                    continue
            self.waiting.remove(request)
            request.state = RequestState.RUNNING
            self.running.append(request)
            step.work.append((request, new))
            step.admitted.append(request)
            budget -= new

    def _start_prefill(self, request: EngineRequest, hit_keys: list[BlockHash], budget: int, cap: int) -> int | None:
        """Take the cached prefix and blocks for a first chunk; its tokens, or None when
        the pool cannot hold it."""
        size = self.config.block_size
        new = capped(min(request.num_tokens - len(hit_keys) * size, budget), cap)
        if not self._take_blocks(request, hit_keys, ceil_div(len(hit_keys) * size + new, size) - len(hit_keys)):
            return None
        self._first_admitted(request, len(hit_keys))
        self._register_full_blocks(request, request.num_computed + new)
        return new

    def _resume_prefill(self, request: EngineRequest, budget: int, cap: int) -> int:
        """A first chunk after the node store's blocks: its blocks are held already."""
        new = capped(min(request.num_tokens - request.num_computed, budget), cap)
        self._register_full_blocks(request, request.num_computed + new)
        return new

    def _tier_run(self, request: EngineRequest, hit: int) -> TierRun:
        """What the node store holds of the prompt past the ``hit`` cached blocks, never the
        last token's block; nothing for a request with a pull source."""
        if self.tier is None or request.pull_source:
            return NO_RUN
        return self.tier.held_run(request.block_keys, hit, (request.num_tokens - 1) // self.config.block_size)

    def _start_load(self, request: EngineRequest, hit_keys: list[BlockHash], run: TierRun, step: Admission) -> bool:
        """Blocks for the whole prompt, less the local hit; the store's ``run`` then loads
        into the blocks after the hit. False when the pool cannot hold them."""
        if not self._take_blocks(request, hit_keys,
                                 ceil_div(request.num_tokens, self.config.block_size) - len(hit_keys)):
            return False
        if request.first_computed_block is None:
            request.tier_tokens = run.blocks * self.config.block_size
            request.tier_disk_tokens = run.disk_blocks * self.config.block_size
        self._first_admitted(request, len(hit_keys) + run.blocks)
        request.state = RequestState.LOADING
        step.loads.append((request, run))
        return True

    def _start_pull(self, request: EngineRequest, step: Admission) -> bool:
        """Blocks for the prompt and the prefill worker's token, less the local hit; the
        pull then moves only the prompt blocks this engine lacks."""
        size = self.config.block_size
        hit_keys = self._hit(request)
        if not self._take_blocks(request, hit_keys, ceil_div(request.num_tokens, size) - len(hit_keys)):
            return False
        self._first_admitted(request, len(request.block_keys))  # every prompt block is cached or pulled
        request.state = RequestState.PULLING
        step.pulls.append((request, ceil_div(request.num_prompt, size) - len(hit_keys)))
        return True

    def _first_admitted(self, request: EngineRequest, first_computed_block: int) -> None:
        """Its first admission says which blocks it computes itself (a later one, after a
        preemption, does not: the connector counts the first)."""
        if request.first_computed_block is None:
            request.first_computed_block = first_computed_block

    def _hit(self, request: EngineRequest) -> list[BlockHash]:
        """The cached leading blocks; never the block holding the last token, which is
        recomputed to sample from."""
        limit = min(len(request.block_keys), (request.num_tokens - 1) // self.config.block_size)
        return request.block_keys[:self.pool.cached_prefix(request.block_keys, limit)]

    def _take_blocks(self, request: EngineRequest, hit_keys: list[BlockHash], fresh: int) -> bool:
        if self.pool.blocks_to_admit(hit_keys, fresh) > self.pool.num_free:
            return False
        self.pool.acquire(hit_keys)
        request.blocks = list(hit_keys)
        self._allocate(request, fresh)
        request.num_computed = len(hit_keys) * self.config.block_size
        request.num_registered = len(hit_keys)
        if request.cached_tokens is None:
            request.cached_tokens = request.num_computed
        return True

    def _decode_run_length(self, step: Admission) -> int:
        """How many identical decode steps can follow: until the first request finishes,
        and no longer than the free blocks last. The run's blocks are allocated when it
        completes (``complete``); nothing else allocates from this pool meanwhile."""
        until_first_finish = min(request.steps_left for request, _ in step.work)

        def extra_blocks(steps: int) -> int:
            return sum(max(0, ceil_div(r.num_computed + steps, self.config.block_size) - len(r.blocks))
                       for r, _ in step.work)

        low, high = 1, until_first_finish  # extra_blocks(1) == 0: the first step is already allocated
        while low < high:
            middle = (low + high + 1) // 2
            if extra_blocks(middle) <= self.pool.num_free:
                low = middle
            else:
                high = middle - 1
        return low

    # ------------------------------------------------------------ after a step

    def complete(self, step: Admission, started_at: float, step_seconds: float) -> list[Produced]:
        """Apply ``step.repeat`` steps of ``step_seconds`` each that began at ``started_at``."""
        produced: list[Produced] = []
        self._free_held()  # held since an earlier step; this step's report says they were sent
        if step.repeat > 1:  # a decode run's blocks, all before anyone finishes, as step by step
            for request, _ in step.work:
                self._allocate(request, ceil_div(request.num_computed + step.repeat, self.config.block_size)
                               - len(request.blocks))
        for request, new in step.work:
            tokens = self._advance(request, new, step.repeat)
            if tokens:
                produced.append(Produced(request, tokens, started_at + step_seconds, step_seconds))
                self._first_output(request)
            if request.steps_left <= 0:
                self._finish(request)
        return produced

    def _advance(self, request: EngineRequest, new: int, repeat: int) -> int:
        """Count the computed tokens; tokens sampled (each step that caught up samples one)."""
        if repeat > 1:  # a decode run: one token computed and one sampled per step
            request.num_computed += repeat
            request.num_output += repeat
            return repeat
        request.num_computed += new
        if request.num_computed < request.num_tokens:
            return 0  # a prompt chunk that was not the last
        request.num_output += 1
        return 1

    def _register_full_blocks(self, request: EngineRequest, tokens: int, evict_first: bool = False) -> None:
        """Cache the prompt's full blocks among its first ``tokens`` (computed, or scheduled
        to be computed in this step); publish them as vLLM would."""
        size = self.config.block_size
        done = min(tokens, request.num_prompt) // size
        run_start = None
        for index in range(request.num_registered, done):
            if request.blocks[index] is None and self.pool.promote(request.block_keys[index], evict_first):
                request.blocks[index] = request.block_keys[index]
                run_start = index if run_start is None else run_start
                continue
            self._publish_run(request, run_start, index)
            run_start = None
        self._publish_run(request, run_start, done)
        request.num_registered = max(request.num_registered, done)

    def _publish_run(self, request: EngineRequest, start: int | None, end: int) -> None:
        if start is not None:
            publish_stored(self.pool, request.block_keys, request.token_ids, start, end, self.config.block_size)

    def _first_output(self, request: EngineRequest) -> None:
        request.awaiting_output = False

    def _finish(self, request: EngineRequest) -> None:
        self.running.remove(request)
        if self.tier is not None and request.block_keys[request.first_computed_block:]:
            self._saves.append(request.block_keys[request.first_computed_block:])
        if request.hold_blocks and self.config.hold_sent_blocks:
            self._held.append(request.blocks)
            request.blocks = []
        else:
            self._release(request)
        request.state = RequestState.FINISHED

    def _free_held(self) -> None:
        for blocks in self._held:
            self.pool.release(blocks)
        self._held = []

    def _preempt(self, request: EngineRequest) -> None:
        """Recompute preemption: drop its KV, keep its output, queue it first."""
        self._release(request)
        request.num_computed = request.num_registered = 0
        request.remote = False  # recomputed here, from this engine's own cache
        request.state = RequestState.WAITING
        self.waiting.insert(0, request)
        self.num_preemptions += 1

    def _allocate(self, request: EngineRequest, count: int) -> None:
        if count > 0:
            self.pool.allocate(count)
            request.blocks.extend([None] * count)

    def _release(self, request: EngineRequest) -> None:
        self.pool.release(request.blocks)
        request.blocks = []


def prefilling(requests: Iterable[EngineRequest]) -> Iterator[EngineRequest]:
    """Those of ``requests`` with no output yet that compute their prompt on this engine."""
    return (request for request in requests if request.awaiting_output and not request.remote)


def capped(tokens: int, cap: int) -> int:
    """``tokens`` limited to ``cap`` when a cap applies (``cap`` > 0)."""
    return min(tokens, cap) if cap > 0 else tokens
