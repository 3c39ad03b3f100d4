"""How much of a claimed prefix a follower reuses (``orchestrator.followers``), against a
real ``PrefixIndex`` fed vLLM-shaped events and the service's claims."""

from __future__ import annotations

import time
from types import SimpleNamespace

from foundation import wire
from foundation.identity import block_hashes
from orchestrator.followers import followable_blocks
from orchestrator.index import PrefixIndex
from orchestrator.load_ledger import LoadLedger
from orchestrator.planner.cost_model import CostModel
from orchestrator.planner.planner import CacheAwarePlanner
from orchestrator.planner.plans import held_blocks, reused_tokens
from orchestrator.planner.views import RequestView, WorkerView
from orchestrator.service import CompletionService
from tests.fake_engine import BS, FakeEngine, S, tokens

CAP = 64  # tokens per prompt per step: 4 blocks of 16
PROMPT = tokens(20, seed=5)
HASHES = block_hashes(PROMPT, BS, S)


def index_with_claim(claimant: str = "owner", stored_blocks: int = 0) -> PrefixIndex:
    index = PrefixIndex()
    index.reset_worker("p0", "p0-inc1")
    if stored_blocks:
        index.apply("p0", FakeEngine(1).store(PROMPT, S, last=stored_blocks))
    index.claim("p0", claimant, HASHES, capacity_blocks=1_000, now=0.0)
    assert index.match(HASHES) == {"p0": 20}
    return index


def follow(index: PrefixIndex, queue: tuple[str, ...], cap: int = CAP) -> int:
    return followable_blocks(index, "p0", HASHES, 20, queue, cap, BS)


def test_a_prefix_queued_behind_another_prompt_gives_its_follower_one_chunk():
    # The owner waits behind "head"; when head's step ends, owner and follower are
    # scheduled in one step: the follower finds the owner's first chunk only.
    assert follow(index_with_claim(), ("head", "owner")) == CAP // BS


def test_what_the_owner_already_stored_counts_in_full_plus_one_chunk():
    assert follow(index_with_claim(stored_blocks=6), ("head", "owner")) == 6 + CAP // BS


def test_the_oldest_prompt_s_prefix_is_followed_in_full():
    assert follow(index_with_claim(), ("owner", "other")) == 20


def test_a_prefix_whose_prefill_is_over_is_followed_in_full():
    # Its first token came (it left the queue); the KV events have not arrived yet.
    assert follow(index_with_claim(), ("head", "other")) == 20


def test_an_engine_serving_prompts_in_turn_lets_the_follower_wait_for_all_of_it():
    assert follow(index_with_claim(), ("head", "owner"), cap=0) == 20


def test_a_prefix_also_claimed_by_the_oldest_prompt_is_followed_in_full():
    index = index_with_claim()
    index.claim("p0", "head", HASHES, capacity_blocks=1_000, now=0.0)
    assert follow(index, ("head", "owner")) == 20


def test_a_fully_stored_prefix_is_not_touched():
    index = index_with_claim(stored_blocks=20)
    assert follow(index, ("head", "owner")) == 20


def test_the_estimate_reuses_the_followable_blocks_and_prefix_routers_see_the_claim():
    request = RequestView("r", prompt_tokens=20 * BS, expected_output_tokens=8, block_size=BS)
    view = WorkerView("p0", "prefill", num_running=0, num_waiting=2, num_queued_prefill_tokens=640,
                      num_free_blocks=100, num_total_blocks=100, block_size=BS, bytes_per_block=1,
                      cached_blocks=20, followable_blocks=4)
    assert reused_tokens(request, view) == 4 * BS
    assert held_blocks(request, view) == 20  # what a prefix-matching router routes on


def test_the_decision_says_when_a_claimed_prefix_will_mostly_be_recomputed():
    request = RequestView("r", prompt_tokens=20 * BS, expected_output_tokens=8, block_size=BS)
    prefill = WorkerView("p0", "prefill", num_running=0, num_waiting=2, num_queued_prefill_tokens=640,
                         num_free_blocks=100, num_total_blocks=100, block_size=BS, bytes_per_block=1,
                         cached_blocks=20, followable_blocks=4)
    decode = WorkerView("d0", "decode", num_running=0, num_waiting=0, num_queued_prefill_tokens=0,
                        num_free_blocks=100, num_total_blocks=100, block_size=BS, bytes_per_block=1)
    decision = CacheAwarePlanner().decide(request, [prefill], [decode], CostModel())
    disagg = next(plan for plan in decision.alternatives if plan.prefill_worker == "p0")
    assert disagg.estimate.reused_tokens == 4 * BS
    assert "p0 holds 20/20 blocks (reuses 4:" in decision.reason


def service_view(queued: dict[str, int], prefilled_since: tuple[str, ...] = ()) -> WorkerView:
    """The completion service's view of p0 after a heartbeat listing ``queued``, with the
    load ledger told of the prefills in ``prefilled_since``."""
    index = index_with_claim()
    ledger = LoadLedger()
    for request_id in prefilled_since:
        ledger.dispatched("p0", request_id, queued[request_id], now=0.0)
        ledger.prefilled("p0", request_id, now=1.0)
    fleet = SimpleNamespace(ledger=ledger, in_flight=lambda worker_id: 0)
    service = CompletionService(fleet, None, {}, "cache_aware", None, index, None, None, None, worker_timeout=1.0)
    load = wire.WorkerLoad(num_waiting=len(queued), num_queued_prefill_tokens=sum(queued.values()),
                           num_free_blocks=100, num_total_blocks=100, block_size=BS, queued_prefill=queued,
                           prompt_step_cap=CAP)
    worker = SimpleNamespace(worker_id="p0", role="prefill", load=load, last_seen=time.monotonic(),
                             node_store=None)
    return service._view(worker, HASHES, 20)


def test_the_service_prices_a_follower_from_the_queue_its_heartbeat_and_ledger_show():
    behind = service_view({"head": 300, "owner": 320})
    assert (behind.cached_blocks, behind.reusable_blocks) == (20, CAP // BS)
    # The oldest ended since the heartbeat: the owner computes alone now, and is followed in full.
    alone = service_view({"head": 300, "owner": 320}, prefilled_since=("head",))
    assert (alone.cached_blocks, alone.reusable_blocks) == (20, 20)
