"""Claims on the blocks a routed request is about to compute: the index counts them as held
where the request is prefilled, until its KV events arrive, it fails, or time runs out;
and the simulator, which feeds the index as the service does, lets a request follow a
prefix that is still being prefilled."""

from __future__ import annotations

import pytest

from foundation.identity import block_hashes
from foundation.kv_events import AllBlocksCleared, BlockRemoved
from orchestrator.index import PrefixIndex
from orchestrator.pending_blocks import PendingSettings
from simulator import EngineConfig, SimCalibration, SimulationSettings, simulate
from simulator.requests import TokenRequest
from tests.fake_engine import BS, FakeEngine, S, tokens

CAPACITY = 1000
SETTINGS = PendingSettings(max_age_seconds=60.0, settle_grace_seconds=2.0)


def index_of(*workers: str) -> PrefixIndex:
    index = PrefixIndex(SETTINGS)
    for worker in workers:
        index.reset_worker(worker, f"{worker}-inc1")
    return index


def hashes(prompt: list[int]) -> list:
    return block_hashes(prompt, BS, S)


def claim(index: PrefixIndex, worker: str, request_id: str, prompt: list[int], now: float = 0.0,
          capacity: int = CAPACITY) -> None:
    index.claim(worker, request_id, hashes(prompt), capacity, now)


PROMPT = tokens(6, seed=1)
SHARES_FOUR = PROMPT[:4 * BS] + tokens(3, seed=2)


def test_a_routed_prompt_is_held_where_it_is_prefilled_before_any_event():
    index = index_of("w1", "w2")
    claim(index, "w1", "r1", PROMPT)
    assert index.match(hashes(PROMPT)) == {"w1": 6}
    assert index.match(hashes(SHARES_FOUR)) == {"w1": 4}
    assert index.num_claimed("w1") == 6 and index.num_blocks("w1") == 0  # claimed, not stored


def test_stored_and_claimed_blocks_join_into_one_prefix():
    index, engine = index_of("w1"), FakeEngine(1)
    index.apply("w1", engine.store(PROMPT, S, last=2))  # the first chunk is in
    claim(index, "w1", "r2", PROMPT[:6 * BS])
    assert index.match(hashes(PROMPT)) == {"w1": 6}


def test_the_stored_prefix_leaves_claims_out():
    """What the engine reported, for telling a stale index from a claim not yet stored."""
    index, engine = index_of("w1", "w2"), FakeEngine(1)
    index.apply("w1", engine.store(PROMPT, S, last=2))
    claim(index, "w1", "r2", PROMPT)
    assert index.match(hashes(PROMPT)) == {"w1": 6}
    assert index.stored_prefix("w1", hashes(PROMPT)) == 2
    assert index.stored_prefix("w2", hashes(PROMPT)) == 0 and index.stored_prefix("gone", hashes(PROMPT)) == 0
    index.apply("w1", engine.store(PROMPT, S, first=2))
    assert index.stored_prefix("w1", hashes(PROMPT)) == 6


def test_a_confirmed_block_is_followed_by_the_index_from_then_on():
    index, engine = index_of("w1"), FakeEngine(1)
    claim(index, "w1", "r1", PROMPT)
    index.apply("w1", engine.store(PROMPT, S))
    assert index.num_claimed("w1") == 0  # every block confirmed
    index.apply("w1", BlockRemoved(block_hashes=engine.hashes(PROMPT, S)[3:]))
    assert index.match(hashes(PROMPT)) == {"w1": 3}  # the eviction shows: no claim masks it


def test_a_settled_claim_lasts_the_grace_then_goes():
    index = index_of("w1")
    claim(index, "w1", "r1", PROMPT, now=0.0)
    index.settle("w1", "r1", now=5.0)
    index.expire_claims(6.9)
    assert index.match(hashes(PROMPT)) == {"w1": 6}  # KV events may still be on their way
    index.expire_claims(7.0)
    assert index.match(hashes(PROMPT)) == {}


def test_an_unsettled_claim_ends_at_its_maximum_age():
    index = index_of("w1")
    claim(index, "w1", "r1", PROMPT, now=10.0)
    index.expire_claims(69.9)
    assert index.match(hashes(PROMPT)) == {"w1": 6}
    index.expire_claims(70.0)
    assert index.match(hashes(PROMPT)) == {} and index.num_claimed("w1") == 0


def test_a_released_claim_goes_at_once_and_leaves_the_other_claims_on_its_blocks():
    index = index_of("w1")
    claim(index, "w1", "r1", PROMPT)
    claim(index, "w1", "r2", SHARES_FOUR)
    index.release("w1", "r1")
    assert index.match(hashes(PROMPT)) == {"w1": 4}
    index.release("w1", "r2")
    assert index.match(hashes(PROMPT)) == {} and index.num_claimed("w1") == 0


@pytest.mark.parametrize("drop", [
    lambda index: index.purge("w1"),  # the worker died
    lambda index: index.reset_worker("w1", "w1-inc2"),  # a new incarnation
    lambda index: index.apply("w1", AllBlocksCleared()),  # its cache was reset
    lambda index: index.load_snapshot("w1", "w1-inc1", []),  # reloaded from a snapshot
])
def test_claims_go_with_the_worker(drop):
    index = index_of("w1", "w2")
    claim(index, "w1", "r1", PROMPT)
    claim(index, "w2", "r2", SHARES_FOUR)
    drop(index)
    assert index.match(hashes(PROMPT)) == {"w2": 4}
    index.settle("w1", "r1", now=1.0)  # the request ends later: nothing left to settle, nothing breaks
    index.release("w1", "r1")
    index.reset_worker("w3", "w3-inc1")  # a new worker may take the purged slot: it inherits nothing
    assert index.match(hashes(PROMPT)) == {"w2": 4}


def test_a_worker_the_index_does_not_follow_gets_no_claim():
    index = index_of("w1")
    claim(index, "unknown", "r1", PROMPT)
    assert index.match(hashes(PROMPT)) == {}


def test_a_prompt_larger_than_the_cache_claims_nothing():
    index = index_of("w1")
    claim(index, "w1", "r1", PROMPT, capacity=5)
    assert index.match(hashes(PROMPT)) == {}


def test_claims_beyond_the_cache_push_out_the_oldest_first():
    index = index_of("w1")
    first, second, third = tokens(4, seed=11), tokens(4, seed=12), tokens(4, seed=13)
    for request_id, prompt in (("r1", first), ("r2", second)):
        claim(index, "w1", request_id, prompt, capacity=10)
    claim(index, "w1", "r3", third, capacity=10)  # 12 blocks would not fit in 10: r1's go
    assert [index.match(hashes(p)) for p in (first, second, third)] == [{}, {"w1": 4}, {"w1": 4}]
    assert index.num_claimed("w1") == 8


def test_a_shared_block_counts_once_against_the_cache():
    index = index_of("w1")
    claim(index, "w1", "r1", PROMPT, capacity=9)
    claim(index, "w1", "r2", SHARES_FOUR, capacity=9)  # 6 + 3 new blocks: both fit
    assert index.match(hashes(PROMPT)) == {"w1": 6} and index.match(hashes(SHARES_FOUR)) == {"w1": 7}


def test_settings_are_checked():
    with pytest.raises(ValueError):
        PendingSettings(max_age_seconds=0)
    with pytest.raises(ValueError):
        PendingSettings(settle_grace_seconds=-1)


# ---------------------------------------------------------------- in the simulator


def test_a_request_arriving_during_its_prefix_s_prefill_follows_it_and_hits():
    """Two idle prefill workers; the second request shares 1,600 of its 1,700 tokens with the
    first and arrives while the first is still prefilling. Without the claim the index shows
    nothing and the second goes cold to the other idle worker."""
    prefix = [1000 + i for i in range(1600)]
    requests = [TokenRequest(0, 0.0, 2, prefix + [5] * 50), TokenRequest(1, 0.1, 2, prefix + [7] * 100)]
    engine = EngineConfig(block_size=BS)
    result = simulate(requests, "cache_aware", 2, 1, SimCalibration(),
                      settings=SimulationSettings(prefill_engine=engine, decode_engine=engine))
    first, second = sorted(result.records, key=lambda r: r.index)
    assert first.ttft_seconds > 0.1  # still prefilling when the second arrived
    assert second.prefill_worker == first.prefill_worker
    assert second.cached_tokens == 1600 and second.predicted_reused_tokens == 1600
