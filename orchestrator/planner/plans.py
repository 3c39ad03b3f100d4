"""Building one plan: is it feasible, and what will it cost? Pure.

Shared by the cache-aware planner and the baselines, so every decision record carries
estimates computed the same way and can be compared side by side.

    LOCAL d:     ttft = queue_wait(d) + tier(d) + prefill(d) + contention(d)
                                                                     gap = 0   (+ interference on d)
    DISAGG p->d: ttft = queue_wait(p) + tier(p) + prefill(p) + contention(p)
                                                                     gap = transfer(p->d) + admission(d)
    PULL s=>u:   ttft = queue_wait(s) + lend(s) + transfer(s->u) + queue_wait(u) + prefill(u, rest)
                        + contention(u)                              gap = 0   (+ interference on u)

``tier(w)``: loading what w's node KV store holds of the prompt beyond w's engine cache
(``prefill_reuse``); the prefill then computes only the rest. A PULL's sink takes the
prefix from the lender and does not look in its store.

(+ queue_delay: what the prefill adds to the prompts queued on its worker, where they share steps)

``interference``: what ranking charges for the ``stall`` a prefill causes the decodes running
on its worker (a decode or unified worker): a share of it, and in full the seconds that push
streams past their TPOT targets (``tpot_overrun``). A PULL's lend is charged on its source
too, but ``stall`` is the prefilling worker's alone, as the orchestrator measures it.

``admission(d)`` includes what is left of d's own queued prefills when the blocks arrive.

``contention`` is what busy engines on the prefilling worker's CPU cores add.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.planner import cost_model as cost
from orchestrator.planner.cost_model import CostModel
from orchestrator.planner.settings import PlannerSettings
from orchestrator.planner.views import Estimate, Plan, PlanKind, RequestView, WorkerView


def ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def prompt_blocks(request: RequestView) -> int:
    return ceil_div(request.prompt_tokens, request.block_size)


def held_blocks(request: RequestView, worker: WorkerView) -> int:
    """Leading prompt blocks the index credits ``worker`` with, stored or claimed (it can
    report more than the prompt has). What prefix-matching routers route on."""
    return min(worker.cached_blocks, prompt_blocks(request))


def reused_tokens(request: RequestView, worker: WorkerView) -> int:
    """Cached tokens a prefill on ``worker`` skips: the blocks it would reuse, never the
    last token, which the engine always recomputes."""
    blocks = min(worker.reusable_blocks, prompt_blocks(request))
    return max(0, min(blocks * request.block_size, request.prompt_tokens - 1))


@dataclass(frozen=True)
class Reuse:
    tokens: int  # prompt tokens a prefill skips: its engine's cache and its node store's
    tier_tokens: int = 0  # of those, loaded from the node store
    tier_seconds: float = 0.0  # the load's estimated time
    tier_disk_tokens: int = 0  # of ``tier_tokens``, those on its disk tier


def tier_load_blocks(request: RequestView, worker: WorkerView) -> tuple[int, int]:
    """(host, disk) blocks a prefill on ``worker`` loads from its node store: the run the
    store holds past the engine's blocks, short of the last token. The engine's connector
    asks the store past its own hit only, so where some of the engine's blocks are still
    being computed for a request ahead (fewer reusable than cached), the store, which
    has not seen them either, gives nothing."""
    if worker.reusable_blocks < worker.cached_blocks:
        return 0, 0
    room = max(0, (request.prompt_tokens - 1) // request.block_size - worker.cached_blocks)
    host = min(worker.tier_host_blocks, room)
    return host, min(worker.tier_disk_blocks, room - host)


def prefill_reuse(request: RequestView, worker: WorkerView, model: CostModel) -> Reuse:
    """What a prefill on ``worker`` skips, and what loading the node store's part costs."""
    engine = reused_tokens(request, worker)
    host, disk = tier_load_blocks(request, worker)
    if host + disk == 0:
        return Reuse(engine)
    tokens = (worker.cached_blocks + host + disk) * request.block_size
    return Reuse(tokens, tokens - engine, cost.tier_load_seconds(model, host, disk, cost.block_bytes(model, worker)),
                 disk * request.block_size)


def blocks_needed(request: RequestView, settings: PlannerSettings) -> int:
    """KV blocks the decode worker holds over the request's lifetime: prompt and output."""
    tokens = request.prompt_tokens + settings.output_tokens(request.expected_output_tokens)
    return ceil_div(tokens, request.block_size)


def concurrency_problem(worker: WorkerView, settings: PlannerSettings) -> str:
    active = cost.active_requests(worker)
    if active >= settings.max_in_flight:
        return f"{worker.worker_id} at concurrency cap ({active}/{settings.max_in_flight})"
    return ""


def queue_problem(worker: WorkerView, settings: PlannerSettings) -> str:
    queued = worker.num_queued_prefill_tokens
    if queued >= settings.max_queued_prefill_tokens:
        return f"{worker.worker_id} over queued-token cap ({queued}/{settings.max_queued_prefill_tokens})"
    return ""


def lacks_room(decode: WorkerView, needed: int, held: int) -> str:
    """Blocks the worker already holds for this prefix count as free: it will not allocate them."""
    if decode.num_free_blocks + held < needed:
        return f"{decode.worker_id} lacks room (needs {needed} blocks, has {decode.num_free_blocks} free + {held} held)"
    return ""


def prefill_worker_problem(worker: WorkerView, settings: PlannerSettings) -> str:
    """Why ``worker`` cannot take one more prefill; empty when it can."""
    return concurrency_problem(worker, settings) or queue_problem(worker, settings)


def decode_worker_problem(worker: WorkerView, request: RequestView, settings: PlannerSettings) -> str:
    """Why ``worker`` cannot decode this request; empty when it can."""
    return decode_problem_for(request, settings)(worker)


def decode_problem_for(request: RequestView, settings: PlannerSettings) -> Callable[[WorkerView], str]:
    """``decode_worker_problem`` with the request's block counts worked out once, for whole pools."""
    needed, total = blocks_needed(request, settings), prompt_blocks(request)

    def problem(worker: WorkerView) -> str:
        return concurrency_problem(worker, settings) or lacks_room(worker, needed, min(worker.cached_blocks, total))

    return problem


def interference_fields(interference: cost.Interference) -> dict[str, float]:
    """An ``Estimate``'s fields for what a prefill costs the decodes running beside it."""
    return dict(interference=interference.charge, stall=interference.stall, tpot_overrun=interference.tpot_overrun,
                tpot_charge=interference.tpot_charge)


def local_plan(request: RequestView, decode: WorkerView, model: CostModel, settings: PlannerSettings) -> Plan:
    reuse = prefill_reuse(request, decode, model)
    reused = reuse.tokens
    prefill = cost.prefill_seconds(model, request.prompt_tokens - reused, reused, decode.role, decode.worker_id)
    queue_wait = cost.queue_wait_seconds(model, decode, prefill)
    contention = cost.contention_seconds(model, decode, queue_wait + prefill)
    interference = cost.local_interference(model, decode, prefill, settings.expected_output_tokens)
    estimate = Estimate(queue_wait=queue_wait, prefill=prefill, transfer=0.0,
                        ttft=queue_wait + reuse.tier_seconds + prefill + contention, gap=0.0, reused_tokens=reused,
                        transfer_bytes=0, **interference_fields(interference),
                        contention=contention, queue_delay=cost.queue_delay_seconds(model, decode, prefill),
                        tier_tokens=reuse.tier_tokens, tier_load=reuse.tier_seconds,
                        tier_disk_tokens=reuse.tier_disk_tokens)
    problem = decode_worker_problem(decode, request, settings) or queue_problem(decode, settings)
    return Plan(PlanKind.LOCAL, decode.worker_id, None, estimate, not problem, problem)


def disagg_plan(request: RequestView, prefill_worker: WorkerView, decode: WorkerView,
                model: CostModel, settings: PlannerSettings) -> Plan:
    """The decode worker pulls only the prompt blocks it does not already hold."""
    reuse = prefill_reuse(request, prefill_worker, model)
    reused = reuse.tokens
    prefill = cost.prefill_seconds(model, request.prompt_tokens - reused, reused, prefill_worker.role,
                                   prefill_worker.worker_id)
    queue_wait = cost.queue_wait_seconds(model, prefill_worker, prefill)
    missing_bytes = (prompt_blocks(request) - held_blocks(request, decode)) * cost.block_bytes(model, decode)
    transfer = cost.transfer_seconds(missing_bytes, model.link(prefill_worker.worker_id, decode.worker_id))
    contention = cost.contention_seconds(model, prefill_worker, queue_wait + prefill)
    ttft = queue_wait + reuse.tier_seconds + prefill + contention
    # Nothing on a prefill worker, whose running requests are prefills; on a unified one, as LOCAL.
    interference = cost.local_interference(model, prefill_worker, prefill, settings.expected_output_tokens)
    estimate = Estimate(queue_wait=queue_wait, prefill=prefill, transfer=transfer,
                        ttft=ttft, gap=transfer + cost.admission_seconds(model, decode, ttft + transfer),
                        reused_tokens=reused, transfer_bytes=missing_bytes, contention=contention,
                        **interference_fields(interference),
                        queue_delay=cost.queue_delay_seconds(model, prefill_worker, prefill),
                        tier_tokens=reuse.tier_tokens, tier_load=reuse.tier_seconds,
                        tier_disk_tokens=reuse.tier_disk_tokens)
    problem = (prefill_worker_problem(prefill_worker, settings)
               or decode_worker_problem(decode, request, settings))
    return Plan(PlanKind.DISAGG, decode.worker_id, prefill_worker.worker_id, estimate, not problem, problem)


def lendable_blocks(request: RequestView, source: WorkerView) -> int:
    """Leading prompt blocks ``source`` can lend: those it would reuse, short of the whole
    prompt, as the borrower computes at least the last token itself."""
    return min(source.reusable_blocks, (request.prompt_tokens - 1) // request.block_size)


def pull_plan(request: RequestView, source: WorkerView, sink: WorkerView, model: CostModel,
              settings: PlannerSettings) -> Plan:
    """``sink`` pulls the leading blocks ``source`` holds, beyond its own, then prefills the rest
    and decodes. ``source`` lends by prefilling just those blocks under a lease: its engine
    finds them cached and recomputes only the last block, which goes through its queue."""
    block = request.block_size
    lent = lendable_blocks(request, source)
    lend_tokens = lent * block
    lend = cost.prefill_seconds(model, block, max(0, lend_tokens - block), source.role, source.worker_id)
    lend_wait = cost.queue_wait_seconds(model, source, lend)
    missing_bytes = max(0, lent - sink.reusable_blocks) * cost.block_bytes(model, sink)
    transfer = cost.transfer_seconds(missing_bytes, model.link(source.worker_id, sink.worker_id))
    # A request with a pull source does not look in its node store (the lender brings the prefix).
    reused = max(lend_tokens, reused_tokens(request, sink))
    prefill = cost.prefill_seconds(model, request.prompt_tokens - reused, reused, sink.role, sink.worker_id)
    queue_wait = lend_wait + lend + transfer + cost.queue_wait_seconds(model, sink, prefill)
    contention = cost.contention_seconds(model, sink, queue_wait + prefill)
    lending = cost.local_interference(model, source, lend, settings.expected_output_tokens)
    interference = cost.local_interference(model, sink, prefill, settings.expected_output_tokens)
    estimate = Estimate(queue_wait=queue_wait, prefill=prefill, transfer=transfer,
                        ttft=queue_wait + prefill + contention, gap=0.0, reused_tokens=reused,
                        transfer_bytes=missing_bytes, contention=contention,
                        interference=lending.charge + interference.charge, stall=interference.stall,
                        tpot_overrun=lending.tpot_overrun + interference.tpot_overrun,
                        tpot_charge=lending.tpot_charge + interference.tpot_charge,
                        queue_delay=(cost.queue_delay_seconds(model, source, lend)
                                     + cost.queue_delay_seconds(model, sink, prefill)))
    problem = (prefill_worker_problem(source, settings) or decode_worker_problem(sink, request, settings)
               or queue_problem(sink, settings))
    return Plan(PlanKind.PULL, sink.worker_id, None, estimate, not problem, problem, source_worker=source.worker_id,
                lend_tokens=lend_tokens)


def describe(plan: Plan) -> str:
    if plan.kind is PlanKind.LOCAL:
        return f"LOCAL {plan.decode_worker}"
    if plan.kind is PlanKind.PULL:
        return f"PULL {plan.source_worker}⇒{plan.decode_worker}"
    return f"DISAGG {plan.prefill_worker}→{plan.decode_worker}"
