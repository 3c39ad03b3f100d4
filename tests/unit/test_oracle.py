"""The reuse oracle on hand-made traces with known answers, and on the synthetic trace's keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundation import identity
from kvroute.bench.oracle import (
    OracleRequest,
    lru_reuse,
    oracle_requests,
    reuse_bounds,
    trace_block_keys,
    unlimited_reuse,
)
from workloads.trace import BlockContent, TraceRequest, load_trace

BLOCK = 10
SYNTHETIC = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def chain(*keys: str, extra_tokens: int = 5) -> OracleRequest:
    """A prompt of ``len(keys)`` full blocks and a partial tail."""
    return OracleRequest(len(keys) * BLOCK + extra_tokens, tuple(keys))


def test_unlimited_cache_counts_the_longest_prefix_seen_before():
    requests = [chain("a", "b", "c"), chain("a", "b", "d"), chain("a", "x", "c"), chain("y"), chain("a", "b", "c")]
    reuse = unlimited_reuse(requests, BLOCK)
    assert reuse.per_request == (0, 20, 10, 0, 30)  # "c" after "x" is not a prefix hit
    assert reuse.reused_tokens == 60
    assert reuse.prompt_tokens == 35 + 35 + 35 + 15 + 35
    assert reuse.hit_rate == pytest.approx(60 / 155)


def test_the_last_token_is_never_a_hit():
    """A prompt of exactly two blocks can reuse only the first: vLLM recomputes the last token."""
    exact = OracleRequest(2 * BLOCK, ("a", "b"))
    assert unlimited_reuse([exact, exact], BLOCK).per_request == (0, BLOCK)
    assert unlimited_reuse([chain("a", "b"), chain("a", "b", extra_tokens=1)], BLOCK).per_request == (0, 20)


def test_lru_evicts_the_least_recently_used_blocks():
    requests = [chain("a", "b"), chain("c", "d"), chain("a", "b"), chain("c", "d")]
    assert lru_reuse(requests, BLOCK, capacity_blocks=4).per_request == (0, 0, 20, 20)
    assert lru_reuse(requests, BLOCK, capacity_blocks=2).per_request == (0, 0, 0, 0)


def test_lru_evicts_tails_before_heads():
    """With room for three blocks, the second chain evicts the first chain's tail, not its head."""
    requests = [chain("a", "b", "c"), chain("x", "y"), chain("a", "b", "c")]
    # after 1: [c b a] (LRU first); after 2: [c b a y x] -> evict c, b -> [a y x]
    assert lru_reuse(requests, BLOCK, capacity_blocks=3).per_request == (0, 0, 10)


def test_lru_hits_refresh_blocks():
    requests = [chain("a"), chain("b"), chain("a"), chain("c"), chain("a")]
    assert lru_reuse(requests, BLOCK, capacity_blocks=2).per_request == (0, 0, 10, 0, 10)


def test_a_chain_longer_than_the_cache_keeps_its_head():
    requests = [chain("a", "b", "c", "d"), chain("a", "b", "c", "d")]
    assert lru_reuse(requests, BLOCK, capacity_blocks=2).per_request == (0, 20)


def test_large_lru_equals_unlimited_and_zero_capacity_reuses_nothing():
    requests = [chain("a", "b", "c"), chain("a", "b", "d"), chain("a", "x"), chain("a", "b", "c")]
    bounds = reuse_bounds(requests, BLOCK, capacity_blocks=1000)
    assert bounds.lru == bounds.unlimited
    assert lru_reuse(requests, BLOCK, 0).reused_tokens == 0


def trace_request(index: int, hash_ids: tuple[int, ...], prompt_tokens: int, arrival: float = 0.0) -> TraceRequest:
    return TraceRequest(index, arrival, prompt_tokens, 4, hash_ids, BlockContent(seed=0, block_tokens=64))


def test_trace_keys_name_full_engine_blocks_by_their_trace_block_and_offset():
    request = trace_request(0, (7, 8), 64 + 40)
    assert trace_block_keys(request, 16) == ((7, 15), (7, 31), (7, 47), (7, 63), (8, 15), (8, 31))
    assert trace_block_keys(request, 128) == ()  # no full 128-token block
    assert trace_block_keys(trace_request(0, (7, 8), 128), 128) == ((8, 63),)


def test_oracle_requests_are_in_arrival_order():
    late, early = trace_request(0, (1,), 64, arrival=2.0), trace_request(1, (2,), 32, arrival=1.0)
    assert [r.prompt_tokens for r in oracle_requests([late, early], 16)] == [32, 64]


@pytest.mark.skipif(not SYNTHETIC.exists(), reason="shared/data not present")
def test_trace_keys_agree_with_chained_token_hashes():
    """The oracle's cheap keys and the hashes the index uses find the same hits."""
    trace = load_trace(SYNTHETIC, limit=300)
    by_keys = unlimited_reuse(oracle_requests(trace.requests, 16), 16)
    by_hashes = unlimited_reuse([OracleRequest(r.prompt_tokens, tuple(identity.block_hashes(
        r.prompt_token_ids, 16, None))) for r in trace.requests], 16)
    assert by_keys == by_hashes
    assert by_keys.reused_tokens > 0
