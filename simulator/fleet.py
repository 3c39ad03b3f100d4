"""The simulated workers as the orchestrator sees them: ``WorkerView``s and a ``PrefixIndex``.

The views carry what the service's do (``orchestrator.service.CompletionService._view``)
from what a worker's heartbeat reports (``worker.process.WorkerProcess.load``):

* ``num_running`` / ``num_waiting``: the engine's running and waiting requests (those
  waiting for remote KV are waiting, as in vLLM's stats);
* ``num_queued_prefill_tokens``: prompt tokens still to compute, of requests submitted
  that have no output on this worker yet (``Engine.queued_prefill_tokens``);
* ``num_free_blocks``: blocks no request references (evictable cached ones are free);
* ``in_flight``: requests placed on this worker that have not finished, counted on every
  worker of the plan until the whole request ends, as ``Fleet.track`` does;
* ``cached_blocks``: from ``PrefixIndex.match`` over the prompt's chained hashes, and
  ``followable_blocks`` from it as the service does (``orchestrator.followers``);
* ``tier_host_blocks`` / ``tier_disk_blocks``: with node stores (``simulator.node_store``),
  the run of prompt blocks past ``cached_blocks`` that the worker's node store holds, from
  the production ``TierHoldings``, fed each store's events as soon as it changes (exact);
* ``decoding``: the requests decoding on the worker that have had a token from it, as the
  orchestrator's ``DecodeStreams`` relays them (``SimWorker.decoding``, kept by the loop).

The index is the production one, fed the way vLLM's KV events feed it in service: each
engine's ``BlockStored`` / ``BlockRemoved`` events, applied after every step. By default
the views are exact at decision time, as if a heartbeat had just arrived from every
worker. With ``stats_at_step_end`` they show what vLLM itself reports: its scheduler
stats (running requests, KV usage) are made once per step, at the step's end, so during
a long prefill step a worker still reports the state before it (``report``). The
orchestrator's own bookkeeping stays exact: in-flight and queued requests (the load
ledger's part), and a decode worker's free blocks, which the ledger corrects for the
requests it reserved room for. Not modelled: the heartbeat's own delay (up to 1 s).

At 1,000 workers a decision must not rebuild 1,000 views: each worker keeps its view
and its load key until its state changes (``touch``), and a pool is handed to the policy
as the service hands it, a ``LazyPool`` that dates a view (and gives a matched worker its
``cached_blocks``) only when the policy reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from foundation import wire
from foundation.identity import BlockHash
from orchestrator.followers import followable_blocks
from orchestrator.index import PrefixIndex
from orchestrator.planner.candidates import load_key
from orchestrator.planner.pools import LazyPool, LoadKey
from orchestrator.planner.views import DecodeStream, WorkerView
from orchestrator.tier_holdings import NO_RUN, TierHoldings
from simulator.engine import Engine, EngineConfig
from simulator.node_store import NodeStore, TierSettings, node_names
from simulator.sequence import Admission


@dataclass
class ActiveStep:
    """The step (or decode run) an engine is computing, and which queue entry ends it.

    ``step_seconds`` is one step at full speed. While the engine shares its cores it
    computes at ``speed`` (``cpu.Cores``): by ``updated_at`` it had done ``work_done``
    full-speed seconds of the run, and ``reshare`` changes the pace from ``now`` on."""

    admission: Admission
    started_at: float
    step_seconds: float
    version: int
    speed: float = 1.0
    work_done: float = 0.0
    updated_at: float = field(init=False)
    slowed: bool = field(init=False)

    def __post_init__(self):
        self.updated_at = self.started_at
        self.slowed = self.speed != 1.0

    @property
    def ends_at(self) -> float:
        return self.updated_at + (self.admission.repeat * self.step_seconds - self.work_done) / self.speed

    def progress(self, now: float) -> float:
        """Full-speed seconds of the run done by ``now``."""
        return self.work_done + (now - self.updated_at) * self.speed

    def reshare(self, now: float, speed: float) -> None:
        self.work_done, self.updated_at, self.speed = self.progress(now), now, speed
        self.slowed = self.slowed or speed != 1.0

    def seconds_per_step(self, now: float) -> float:
        """Each step's wall time, for a run that ends at ``now``."""
        return (now - self.started_at) / self.admission.repeat if self.slowed else self.step_seconds


class SimWorker:
    def __init__(self, worker_id: str, role: str, config: EngineConfig, bytes_per_token: int,
                 stats_at_step_end: bool = False, slots: tuple[tuple[set[int], int], ...] = (),
                 store: NodeStore | None = None):
        self.worker_id = worker_id
        # Per pool it is in (a unified worker is in both): that pool's set of workers touched
        # since read, and its position there.
        self._slots = slots
        self.role = role
        self.store = store  # its node's KV store (None: no node tier)
        self.engine = Engine(config, store)
        self.bytes_per_block = bytes_per_token * config.block_size
        self.in_flight = 0
        self.decoding: dict[str, DecodeStream] = {}  # request id → its stream here (the loop's)
        self.active: ActiveStep | None = None
        self.version = 0  # bumped whenever the pending step event is superseded
        self.num_steps = 0
        self.stats_at_step_end = stats_at_step_end
        self._reported = (0, config.num_blocks)  # (running, free blocks) at the last step's end
        self._view: WorkerView | None = None
        self._load_key: LoadKey | None = None  # of the cached view
        self._oldest_queued_at: float | None = None  # of the cached view's queued prompts
        self._queue_order: tuple[str, ...] = ()  # their request ids

    def touch(self) -> None:
        """Its state changed: the next decision needs a fresh view."""
        self._view = None
        for changed, position in self._slots:
            changed.add(position)

    def load_key(self) -> LoadKey:
        """``candidates.load_key`` of its view now (dating a view leaves its load as it is)."""
        self._static_view()
        return self._load_key

    def report(self) -> None:
        """A step ended (or the engine went idle): vLLM makes its scheduler stats now."""
        self._reported = (len(self.engine.running), self.engine.pool.num_free)

    def view(self, now: float) -> WorkerView:
        """What a heartbeat and the ledger would tell the planner now. The oldest queued
        prompt's age moves with the clock, and the streams decoding here (the orchestrator's
        own bookkeeping) are read only where a policy reads the view: both are added to the
        cached view."""
        view = self._static_view()
        changes = {}
        if self._oldest_queued_at is not None and self.active is not None:
            changes["head_prompt_elapsed"] = max(0.0, now - max(self._oldest_queued_at, self.active.started_at))
        if self.decoding:
            changes["decoding"] = tuple(self.decoding.values())
        return copied_with(view, changes) if changes else view

    def queue_order(self) -> tuple[str, ...]:
        """The request ids of the prompts queued here, oldest first, as of the view."""
        self._static_view()
        return self._queue_order

    def _static_view(self) -> WorkerView:
        if self._view is None:
            engine, pool = self.engine, self.engine.pool
            running, free = len(engine.running), pool.num_free
            queued = engine.queued_prompts()
            self._oldest_queued_at = engine.oldest_queued_at()  # changes only with the engine, as the view
            self._queue_order = engine.queued_request_ids()
            if self.stats_at_step_end:
                running = self._reported[0]
                free = self._reported[1] if self.role == "prefill" else free  # the ledger's, for decode
            self._view = WorkerView(
                worker_id=self.worker_id, role=self.role, num_running=running,
                num_waiting=len(engine.waiting), num_queued_prefill_tokens=sum(queued),
                queued_prompts=queued, prompt_step_cap=engine.config.long_prefill_tokens,
                num_free_blocks=free, num_total_blocks=pool.num_total,
                block_size=engine.config.block_size, bytes_per_block=self.bytes_per_block,
                in_flight=self.in_flight, resident_blocks=pool.num_cached)
            self._load_key = load_key(self._view)
        return self._view


def copied_with(view: WorkerView, changes: dict) -> WorkerView:
    """``replace(view, **changes)``, without re-running the view's ``__init__`` over all its
    fields (8 µs against 0.9 µs): the copy is made for every busy worker on every decision,
    about 300 a decision at 500 + 500 workers."""
    copied = object.__new__(WorkerView)
    copied.__dict__.update(view.__dict__)
    copied.__dict__.update(changes)
    return copied


class SimFleet:
    """The workers of ``counts`` (workers per role) with ``configs`` (an engine per role), in
    fleet order: prefill workers, decode workers, then unified ones. The planner's two pools
    are the prefill workers then the unified ones, and the decode workers then the unified
    ones: a unified worker's one engine is in both, as ``foundation.wire.serves`` says."""

    def __init__(self, counts: Mapping[str, int], configs: Mapping[str, EngineConfig], bytes_per_token: int,
                 stats_at_step_end: bool = False, tier: TierSettings = TierSettings()):
        check_counts(counts)
        roles = [role for role in wire.ROLES if counts.get(role, 0) > 0]
        if len({configs[role].block_size for role in roles}) > 1:
            raise ValueError("every engine must share a block size, as the orchestrator assumes")
        self.block_size = configs[roles[0]].block_size
        width = len(str(max(counts.get(role, 0) for role in roles)))
        ids = [(role, f"{role}-{i:0{width}d}") for role in roles for i in range(counts[role])]
        # Per pool: each member's position, every member's load key as of the last decision,
        # and the positions of those touched since (so a decision re-reads the few that
        # changed, not all 1,000).
        self._positions = {pool: {worker_id: position for position, worker_id in
                                  enumerate(w for role, w in ids if wire.serves(role, pool))}
                           for pool in wire.POOLS}
        self._changed: dict[str, set[int]] = {pool: set(members.values()) for pool, members in self._positions.items()}
        self._load_keys: dict[str, list[LoadKey | None]] = {pool: [None] * len(members)
                                                            for pool, members in self._positions.items()}
        self.stores = node_stores([worker_id for _, worker_id in ids], tier)  # worker id → its node's store
        self.tiers = TierHoldings()  # what the stores hold, as the orchestrator knows it
        self.workers = {
            worker_id: SimWorker(worker_id, role, configs[role], bytes_per_token, stats_at_step_end,
                                 tuple((self._changed[pool], members[worker_id])
                                       for pool, members in self._positions.items() if worker_id in members),
                                 self.stores.get(worker_id))
            for role, worker_id in ids}
        self.pools: dict[str, list[SimWorker]] = {pool: [self.workers[w] for w in members]
                                                  for pool, members in self._positions.items()}
        self.index = PrefixIndex()
        for worker_id in self.workers:
            self.index.reset_worker(worker_id, f"{worker_id}-sim")

    def publish(self, worker: SimWorker) -> None:
        """Hand the engine's KV events to the index, in order, as the index-sync task does."""
        for event in worker.engine.pool.take_events():
            self.index.apply(worker.worker_id, event)

    def publish_store(self, store: NodeStore) -> None:
        """Hand a store's events to the holdings, as the tier sync does (at once: views are exact)."""
        self.tiers.apply((store.name, ""), store.take_events())

    def write_through(self, worker: SimWorker) -> None:
        """Store what the requests that ended on ``worker`` computed themselves in its node's store."""
        saves = worker.engine.take_saves()
        for blocks in saves:
            worker.store.write(blocks)
        if saves:
            self.publish_store(worker.store)

    def views(self, role: str, block_hashes: list[BlockHash], matches: dict[str, int], now: float) -> LazyPool:
        workers = self.pools[role]

        def build(position: int) -> WorkerView:
            worker, blocks = workers[position], cached[position]
            view = worker.view(now)
            tier = NO_RUN if worker.store is None else self.tiers.run((worker.store.name, ""), block_hashes, blocks)
            if not blocks and tier is NO_RUN:
                return view
            followable = followable_blocks(self.index, worker.worker_id, block_hashes, blocks,
                                           worker.queue_order(), view.prompt_step_cap,
                                           self.block_size) if blocks else None
            return replace(view, cached_blocks=blocks, followable_blocks=followable,
                           tier_host_blocks=tier.host_blocks, tier_disk_blocks=tier.disk_blocks)

        load_keys, changed = self._load_keys[role], self._changed[role]
        for position in changed:
            load_keys[position] = workers[position].load_key()
        changed.clear()
        cached = [0] * len(workers)
        positions = self._positions[role]
        for worker_id, blocks in matches.items():
            if worker_id in positions:
                cached[positions[worker_id]] = blocks
        # The pool shares the key list: it is read within this decision, before any worker changes.
        return LazyPool(load_keys, self._reachable(workers, block_hashes, cached) if self.stores else cached, build)

    def _reachable(self, workers: list[SimWorker], block_hashes: list[BlockHash], cached: list[int]) -> list[int]:
        """Each worker's engine blocks and its node store's run after them, as the service prunes by."""
        reach = self.tiers.reach(block_hashes)
        return [reach(None if worker.store is None else (worker.store.name, ""), blocks)
                for worker, blocks in zip(workers, cached)]


def check_counts(counts: Mapping[str, int]) -> None:
    """A fleet serves with a unified worker, or with prefill and decode workers both (as
    ``kvroute serve`` requires of a topology)."""
    if any(counts.get(role, 0) < 0 for role in wire.ROLES) or set(counts) - set(wire.ROLES):
        raise ValueError(f"worker counts must be non-negative, per role of {wire.ROLES}: {dict(counts)}")
    if not counts.get("unified") and not (counts.get("prefill") and counts.get("decode")):
        raise ValueError("the service needs a live prefill and a live decode worker, or a unified one; "
                         "so does the simulator")


def node_stores(worker_ids: list[str], tier: TierSettings) -> dict[str, NodeStore]:
    """Worker id → the store of its node (``node_store.node_names``); none without a tier."""
    if not tier.enabled:
        return {}
    nodes = node_names(worker_ids, tier.workers_per_node)
    stores = {name: NodeStore(name, tier) for name in sorted(set(nodes.values()))}
    return {worker_id: stores[name] for worker_id, name in nodes.items()}
