"""The event loop: requests arrive, the policy places them, engines step, KV moves, requests end.

::

    arrive ─▶ plan: index match → WorkerViews → policy.decide(request, prefill, decode, model)
      │  no plan (every worker at its cap): re-plan when a request ends, or every 0.25 s;
      │  still none after the admission wait: rejected (a 429 in service)
      ├─ LOCAL d:     d prefills (token 1) and decodes 2..N
      ├─ PULL s⇒u:    s lends the prompt's cached head, the blocks u lacks move to u, and u
      │               computes the rest and decodes (``simulator.lending``)
      └─ DISAGG p→d:  p prefills (token 1) ─▶ d admits it (local hit, blocks) ─▶ pull of the
                      prompt blocks d lacks over d's link ─▶ d decodes 2..N
    (with node stores: a prefilling engine first loads what its node's store holds past its
     own hit, then computes the rest; a request that ends writes what it computed through)

It mirrors ``orchestrator.service.CompletionService``: the same index lookup and views
feed the same policy objects, a plan's workers count the request in flight until it
ends, its prompt blocks are claimed in the index on its prefilling worker until its
first token, and waiting for capacity re-plans as ``admit`` does. Each engine has at most one
pending step event; when something arrives for an engine in the middle of a decode run,
the run is cut at the next step boundary and its event rescheduled (the old one is
recognised as stale by the worker's version). Engines that share CPU cores (``cpu``)
report their cores to the planner when pinned, as workers do, and
are retimed the same way whenever one of them starts or ends a step: the step in
progress keeps the work it has done and goes on at the new pace. A request whose index
is in ``failed_pulls`` has its pull refused, and its decode worker prefills it again,
as kvroute's connector does: for replaying the faults of a real run.

Checks that hold by construction and are enforced as the simulation runs: the clock
never goes backwards (``EventQueue``), no pool ever has more blocks in use than it holds
(``BlockPool``), and every request ends exactly once (``_end``); ``run`` finally checks
that nothing is left behind: no request in any engine, no block in use.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from foundation import identity
from orchestrator.core_sharing import with_core_neighbours
from orchestrator.planner.cost_model import CostModel
from orchestrator.planner.policies import Policy
from orchestrator.planner.views import Decision, DecodeStream, PlanKind, RequestView
from orchestrator.tier_holdings import TierRun
from simulator.calibration import SimCalibration
from simulator.cpu import Cores, CpuSettings, core_bindings
from simulator.events import EventQueue
from simulator.fleet import ActiveStep, SimFleet, SimWorker
from simulator.flight import PENDING, RUNNING, Flight, record_of
from simulator.lending import lend_request, lent_blocks_missing, take_lent_blocks
from simulator.links import Links
from simulator.records import FINISHED, REJECTED, RequestRecord
from simulator.requests import ReplayRequest
from simulator.sequence import EngineRequest, Produced, RequestState
from simulator.stopping import StopRule


class ConservationError(AssertionError):
    pass


@dataclass(frozen=True)
class AdmissionSettings:
    """The service's admission loop (``CompletionService.admit``): how long a request waits
    for a feasible plan before a 429, and how often it re-plans meanwhile."""

    wait_seconds: float = 10.0  # OrchestratorSettings.admission_wait_seconds
    replan_seconds: float = 0.25  # service.ADMISSION_REPLAN_SECONDS


class Simulation:
    def __init__(self, requests: Sequence[ReplayRequest], policy: Policy, fleet: SimFleet,
                 calibration: SimCalibration, cost_model: CostModel, admission: AdmissionSettings, seed: int,
                 cpu: CpuSettings = CpuSettings(), failed_pulls: frozenset[int] = frozenset(),
                 tpot_target: float = 0.0):
        """``tpot_target``: every request's, as the orchestrator's ``--tpot-target-seconds`` (0: none)."""
        self.requests, self.policy, self.fleet = requests, policy, fleet
        self.tpot_target = tpot_target
        self.calibration, self.cost_model, self.admission = calibration, cost_model, admission
        self.clock = EventQueue()
        self.links = Links(calibration)
        self.cores = Cores(cpu, list(fleet.workers))
        self.bindings = core_bindings(self.cores)
        self.failed_pulls = failed_pulls
        self.flights: dict[str, Flight] = {}
        self.lends: dict[str, Flight] = {}  # a PULL's lend request id → its flight, until lent
        self.pending: list[Flight] = []  # waiting for a feasible plan, oldest first
        self._jitter = random.Random(seed)
        self.stopped_early = False
        bind_prompts = getattr(policy, "bind_prompts", None)  # a router that reads the prompt (peer models)
        if bind_prompts is not None:
            bind_prompts(lambda request_id: self.flights[request_id].block_hashes)

    # ------------------------------------------------------------ the run

    def run(self, stop: StopRule | None = None) -> list[RequestRecord]:
        """The records of the requests that arrived: all of them, each ended, unless ``stop``
        settled the run early (``stopped_early``; then some are still pending or running)."""
        for position, request in enumerate(self.requests):
            self.clock.at(request.arrival_seconds, self._arrive, request, f"req-{position:06d}-{request.index}")
        settled = None if stop is None else (lambda: stop.settled(self.flights.values(), self.now))
        self.stopped_early = self.clock.run(settled, stop.check_every if stop else 1)
        if not self.stopped_early:
            self._check_nothing_left()
        return [record_of(flight) for flight in self.flights.values()]

    @property
    def now(self) -> float:
        return self.clock.now

    def _arrive(self, request: ReplayRequest, request_id: str) -> None:
        token_ids = request.prompt_token_ids
        flight = Flight(request, request_id, token_ids, identity.block_hashes(token_ids, self.fleet.block_size, None),
                        prompt_tokens=len(token_ids), admit_by=self.now + self.admission.wait_seconds)
        self.flights[request_id] = flight
        if not self._try_place(flight):
            self.pending.append(flight)
            self._retry_later(flight)

    # ------------------------------------------------------------ placement

    def _decide(self, flight: Flight) -> Decision:
        self.fleet.index.expire_claims(self.now)
        matches = self.fleet.index.match(flight.block_hashes)
        request = RequestView(flight.request_id, flight.prompt_tokens, flight.request.max_tokens,
                              self.fleet.block_size)
        prefill = self.fleet.views("prefill", flight.block_hashes, matches, self.now)
        decode = self.fleet.views("decode", flight.block_hashes, matches, self.now)
        if self.bindings:  # pinned engines report their cores, as a worker's heartbeats do
            views = with_core_neighbours([*prefill, *decode], self.bindings)
            prefill, decode = views[:len(prefill)], views[len(prefill):]
        return self.policy.decide(request, prefill, decode, self.cost_model)

    def _try_place(self, flight: Flight) -> bool:
        decision = self._decide(flight)
        if decision.chosen is None:
            return False
        flight.decision, flight.status = decision, RUNNING
        for worker_id in decision.chosen.workers:
            worker = self.fleet.workers[worker_id]
            worker.in_flight += 1
            worker.touch()
        kind = decision.chosen.kind
        prefilling = self.fleet.workers[flight.prefilling_worker]
        self.fleet.index.claim(prefilling.worker_id, flight.request_id, flight.block_hashes,
                               prefilling.engine.pool.num_total, self.now)
        if kind is PlanKind.PULL:  # the source lends first (``simulator.lending``)
            lend = lend_request(flight, decision.chosen, self.fleet.block_size)
            self.lends[lend.request_id] = flight
            self._submit(self.fleet.workers[decision.chosen.source_worker], lend)
            return True
        local = kind is PlanKind.LOCAL
        self._submit(prefilling,
                     EngineRequest(flight.request_id, flight.token_ids, flight.block_hashes,
                                   max_tokens=flight.request.max_tokens if local else 1, hold_blocks=not local))
        return True

    def _retry_later(self, flight: Flight) -> None:
        wait = min(self.admission.replan_seconds, max(0.0, flight.admit_by - self.now))
        self.clock.at(self.now + wait, self._retry, flight)

    def _retry(self, flight: Flight) -> None:
        if flight.status != PENDING:
            return
        if self._try_place(flight):
            self.pending.remove(flight)
        elif self.now >= flight.admit_by:
            self.pending.remove(flight)
            flight.status = REJECTED
            flight.token_ids, flight.block_hashes = None, []
        else:
            self._retry_later(flight)

    def _capacity_freed(self) -> None:
        """A request ended: every waiting request re-plans, oldest first (as ``admit`` wakes)."""
        for flight in list(self.pending):
            if self._try_place(flight):
                self.pending.remove(flight)

    # ------------------------------------------------------------ engines

    def _submit(self, worker: SimWorker, request: EngineRequest) -> None:
        request.submitted_at = self.now
        worker.engine.submit(request)
        worker.touch()
        self._wake(worker)

    def _wake(self, worker: SimWorker) -> None:
        """Something new for ``worker``: start a step if it is idle, else join at the next
        step boundary (a decode run is cut there)."""
        if worker.active is None:
            self._start_step(worker)
            return
        active = worker.active
        steps_begun = math.floor(active.progress(self.now) / active.step_seconds) + 1
        if steps_begun < active.admission.repeat:
            active.admission.cut(steps_begun)
            worker.version += 1
            active.version = worker.version
            self.clock.at(max(self.now, active.ends_at), self._step_done, worker, worker.version)

    def _start_step(self, worker: SimWorker) -> None:
        admission = worker.engine.schedule()
        # What scheduling cached or evicted reaches the index when the step ends, as vLLM
        # publishes a step's KV events after its forward pass (``_step_done``).
        worker.touch()
        for request, num_blocks in admission.pulls:
            self._start_pull(worker, request, num_blocks)
        for request, run in admission.loads:
            self._start_load(worker, request, run)
        for request in admission.admitted:
            flight = self.flights.get(request.request_id)  # None: a lend
            if flight and flight.prefill_started_at is None and worker.worker_id == flight.prefilling_worker:
                flight.prefill_started_at = self.now
        if not admission.work:
            worker.report()  # idle: what it reports now stays true until its next step ends
            return
        seconds = self.calibration.step_seconds(admission.prefill_chunks(), admission.num_decodes())
        if self.calibration.step_jitter:
            seconds *= self._jitter.lognormvariate(0.0, self.calibration.step_jitter)
        worker.version += 1
        worker.num_steps += admission.repeat
        slowed = self.cores.set_busy(worker.worker_id, True)
        worker.active = ActiveStep(admission, self.now, seconds, worker.version, self.cores.speed(worker.worker_id))
        self.clock.at(worker.active.ends_at, self._step_done, worker, worker.version)
        self._reshare(slowed)

    def _step_done(self, worker: SimWorker, version: int) -> None:
        if version != worker.version:
            return  # superseded: the run was cut, or retimed, and rescheduled
        active, worker.active = worker.active, None
        produced = worker.engine.complete(active.admission, active.started_at, active.seconds_per_step(self.now))
        worker.report()
        self.fleet.publish(worker)
        if worker.store is not None:
            self.fleet.write_through(worker)
        worker.touch()
        for tokens in produced:
            self._tokens(worker, tokens)
        if worker.active is None:
            self._start_step(worker)
        if worker.active is None:
            self._reshare(self.cores.set_busy(worker.worker_id, False))

    def _reshare(self, worker_ids: list[str]) -> None:
        """The sharing of these engines' cores changed: their steps go on at the new pace."""
        for worker_id in worker_ids:
            worker = self.fleet.workers[worker_id]
            active, speed = worker.active, self.cores.speed(worker_id)
            if active is None or speed == active.speed:
                continue
            active.reshare(self.now, speed)
            worker.version += 1
            active.version = worker.version
            self.clock.at(max(self.now, active.ends_at), self._step_done, worker, worker.version)

    def _start_pull(self, worker: SimWorker, request: EngineRequest, num_blocks: int) -> None:
        flight = self.flights[request.request_id]
        if flight.request.index in self.failed_pulls:
            self.clock.at(self.now, self._pull_refused, worker, request)
            return
        flight.transfer_bytes = num_blocks * worker.bytes_per_block
        arrives_at = self.links.transfer(worker.worker_id, flight.transfer_bytes, self.now)
        flight.transfer_seconds = arrives_at - self.now
        self.clock.at(arrives_at, self._pulled, worker, request)

    def _start_load(self, worker: SimWorker, request: EngineRequest, run: TierRun) -> None:
        """The engine reads ``run`` from its node's store, after its own hit, then computes the rest."""
        worker.store.load(request.block_keys, request.num_registered, run.blocks)
        self.fleet.publish_store(worker.store)
        seconds = self.calibration.tier_load_seconds(run.host_blocks, run.disk_blocks, worker.bytes_per_block)
        flight = self.flights.get(request.request_id)  # None: a lend
        if flight and flight.prefill_started_at is None:
            flight.prefill_started_at = self.now
            flight.tier_load_seconds = seconds
        self.clock.at(self.now + seconds, self._loaded, worker, request, run.blocks)

    def _loaded(self, worker: SimWorker, request: EngineRequest, num_blocks: int) -> None:
        worker.engine.tier_loaded(request, num_blocks)
        self.fleet.publish(worker)
        worker.touch()
        self._wake(worker)

    def _pull_refused(self, worker: SimWorker, request: EngineRequest) -> None:
        worker.engine.pull_failed(request)
        worker.touch()
        self._wake(worker)

    def _pulled(self, worker: SimWorker, request: EngineRequest) -> None:
        worker.engine.pull_done(request)
        self.fleet.publish(worker)
        worker.touch()
        self._wake(worker)

    # ------------------------------------------------------------ tokens and endings

    def _tokens(self, worker: SimWorker, produced: Produced) -> None:
        if produced.request.request_id in self.lends:
            self._lent(self.lends.pop(produced.request.request_id))
            return
        flight = self.flights[produced.request.request_id]
        if worker.worker_id == flight.plan.decode_worker:
            self._decoded(worker, flight, produced)
        if flight.tokens_out == 0:
            self.fleet.index.settle(worker.worker_id, flight.request_id, self.now)
            flight.first_token_at = produced.first_at
            first = produced.request
            flight.cached_tokens = (first.cached_tokens or 0) + first.tier_tokens  # as vLLM counts them
            flight.tier_tokens, flight.tier_disk_tokens = first.tier_tokens, first.tier_disk_tokens
        if flight.tokens_out < 2 <= flight.tokens_out + produced.count:
            flight.second_token_at = produced.token_at(1 - flight.tokens_out)
        flight.tokens_out += produced.count
        flight.last_token_at = produced.last_at
        if produced.request.state is not RequestState.FINISHED:
            return
        if flight.tokens_out >= flight.request.max_tokens:
            self._end(flight)
        else:  # DISAGG: the prefill worker's token 1 is out; the decode worker takes over
            self._submit(self.fleet.workers[flight.plan.decode_worker],
                         EngineRequest(flight.request_id, flight.token_ids, flight.block_hashes,
                                       max_tokens=flight.request.max_tokens, num_output=1, remote=True))

    def _decoded(self, worker: SimWorker, flight: Flight, produced: Produced) -> None:
        """``flight``'s stream on its decode worker, as the orchestrator relays it
        (``orchestrator.decode_streams``): its gaps and seconds there, from its first token there."""
        stream = worker.decoding.get(flight.request_id)
        if stream is None:
            gaps, seconds = produced.count - 1, produced.last_at - produced.first_at
        else:
            gaps = stream.decoded_tokens + produced.count
            seconds = stream.decode_seconds + produced.last_at - flight.last_token_at
        tokens_left = flight.request.max_tokens - flight.tokens_out - produced.count
        worker.decoding[flight.request_id] = DecodeStream(self.tpot_target, gaps, seconds, tokens_left)

    def _lent(self, flight: Flight) -> None:
        """A PULL's source lent its blocks (its token is dropped): those the sink lacks move."""
        sink = self.fleet.workers[flight.plan.decode_worker]
        flight.transfer_bytes = lent_blocks_missing(sink.engine, flight, flight.plan) * sink.bytes_per_block
        arrives_at = self.links.transfer(sink.worker_id, flight.transfer_bytes, self.now)
        flight.transfer_seconds = arrives_at - self.now
        self.clock.at(arrives_at, self._lend_landed, sink, flight)

    def _lend_landed(self, sink: SimWorker, flight: Flight) -> None:
        take_lent_blocks(sink.engine, flight, flight.plan)
        self.fleet.publish(sink)
        self._submit(sink, EngineRequest(flight.request_id, flight.token_ids, flight.block_hashes,
                                         max_tokens=flight.request.max_tokens))

    def _end(self, flight: Flight) -> None:
        if flight.status != RUNNING:
            raise ConservationError(f"{flight.request_id} ended twice (status {flight.status})")
        flight.status = FINISHED
        flight.token_ids, flight.block_hashes = None, []  # no longer needed; 4,000 prompts add up
        self.fleet.workers[flight.plan.decode_worker].decoding.pop(flight.request_id, None)
        for worker_id in flight.plan.workers:
            worker = self.fleet.workers[worker_id]
            worker.in_flight -= 1
            worker.touch()
        self._capacity_freed()

    def _check_nothing_left(self) -> None:
        unfinished = [f.request_id for f in self.flights.values() if f.status not in (FINISHED, REJECTED)]
        if unfinished or self.lends or len(self.flights) != len(self.requests):
            raise ConservationError(f"{len(unfinished)} requests never ended, e.g. {unfinished[:3]}; "
                                    f"{len(self.flights)} of {len(self.requests)} arrived")
        for worker in self.fleet.workers.values():
            engine = worker.engine
            if not engine.empty or engine.pool.num_used or worker.in_flight or worker.active or worker.decoding:
                raise ConservationError(f"{worker.worker_id} left with {len(engine.running)} running, "
                                        f"{len(engine.waiting)} waiting, {engine.pool.num_used} blocks in use, "
                                        f"{worker.in_flight} in flight, {len(worker.decoding)} streams decoding")
        if self.cores.busy:
            raise ConservationError(f"engines still marked busy on their cores: {sorted(self.cores.busy)}")
