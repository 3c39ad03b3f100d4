"""Pulled blocks first to evict, on vLLM's own block pool: ``transfer.free_queue.demote``
and the consumer's scheduler half that calls it when a request ends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, get_block_hash, make_block_hash_with_group_id
from vllm.v1.request import RequestStatus

from tests.unit.connector_requests import BLOCK_SIZE, P, consumer_request, produce
from transfer.connector_scheduler import ConnectorScheduler
from transfer.free_queue import demote
from transfer.settings import ConnectorSettings


def new_pool(num_blocks: int) -> BlockPool:
    return BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE)


def take(pool: BlockPool, label: str, count: int) -> list:
    """``count`` blocks holding full blocks of prompt ``label``, cached as vLLM caches them."""
    blocks = pool.get_new_blocks(count)
    for position, block in enumerate(blocks):
        key = make_block_hash_with_group_id(BlockHash(f"{label}-{position}".encode()), 0)
        block.set_block_hash(key)
        pool.cached_block_hash_to_block.insert(key, block)
    return blocks


def free(pool: BlockPool, blocks: list) -> None:
    pool.free_blocks(reversed(blocks))  # as vLLM frees a request's blocks: tail first


def labels(blocks: list) -> list[str]:
    return [get_block_hash(b.block_hash).decode() if b.block_hash is not None else "-" for b in blocks]


def queue_labels(pool: BlockPool) -> list[str]:
    return labels(pool.free_block_queue.get_all_free_blocks())


def test_demoted_blocks_go_behind_the_never_cached_run_and_before_older_cached_ones():
    pool = new_pool(10)  # block 0 is vLLM's null block: 9 usable
    own = take(pool, "own", 3)
    free(pool, own)
    pulled = take(pool, "pulled", 2)
    free(pool, pulled)
    assert queue_labels(pool) == ["-"] * 4 + ["own-2", "own-1", "own-0", "pulled-1", "pulled-0"]

    assert demote(pool.free_block_queue, list(reversed(pulled)))
    assert queue_labels(pool) == ["-"] * 4 + ["pulled-1", "pulled-0", "own-2", "own-1", "own-0"]
    assert pool.free_block_queue.num_free_blocks == 9

    pool.get_new_blocks(4 + 1)  # the never-cached ones first, then the pulled tail
    assert queue_labels(pool) == ["pulled-0", "own-2", "own-1", "own-0"]


def test_demote_waits_while_a_long_never_cached_run_leads():
    pool = new_pool(10)
    pulled = take(pool, "pulled", 2)
    own = take(pool, "own", 1)
    free(pool, own)
    free(pool, pulled)
    before = queue_labels(pool)
    assert not demote(pool.free_block_queue, list(reversed(pulled)), scan_limit=3)  # 6 never-cached lead
    assert queue_labels(pool) == before
    assert demote(pool.free_block_queue, list(reversed(pulled)), scan_limit=7)
    assert queue_labels(pool) == ["-"] * 6 + ["pulled-1", "pulled-0", "own-0"]


def test_demote_with_no_other_cached_block_moves_nothing():
    pool = new_pool(6)
    pulled = take(pool, "pulled", 2)
    free(pool, pulled)
    assert demote(pool.free_block_queue, list(reversed(pulled)))
    assert queue_labels(pool) == ["-"] * 3 + ["pulled-1", "pulled-0"]


# ---------------------------------------------------------------- the consumer's scheduler half


def finish_a_pull(pool: BlockPool, evict_pulled_first: bool) -> tuple[ConnectorScheduler, list, list]:
    """A consumer's request pulls the 5-block prompt into fresh blocks, decodes, and ends;
    an older prompt this engine prefilled itself is cached beside it."""
    own = take(pool, "own", 3)
    free(pool, own)
    scheduler = ConnectorScheduler(ConnectorSettings(transfer_address="tcp://consumer:1",
                                                     evict_pulled_first=evict_pulled_first), BLOCK_SIZE)
    source, _ = produce()
    request = consumer_request(source)
    blocks = pool.get_new_blocks(6)  # the prompt's 5 blocks and one for output
    scheduler.update_state_after_alloc(request, SimpleNamespace(blocks=(blocks,)), P)
    scheduler.build_connector_meta()
    for position, block in enumerate(blocks[:5]):  # the load landed: vLLM caches the full blocks
        key = make_block_hash_with_group_id(BlockHash(f"pulled-{position}".encode()), 0)
        block.set_block_hash(key)
        pool.cached_block_hash_to_block.insert(key, block)
    request.status = RequestStatus.FINISHED_STOPPED
    scheduler.request_finished(request, [b.block_id for b in blocks])
    free(pool, blocks)
    return scheduler, own, blocks


@pytest.mark.parametrize("evict_pulled_first, evicted", [
    (True, ["pulled-4", "pulled-3"]),
    (False, ["own-2", "own-1"]),
])
def test_a_consumer_evicts_what_it_pulled_before_what_it_prefilled_only_when_told(evict_pulled_first, evicted):
    pool = new_pool(10)
    scheduler, _, blocks = finish_a_pull(pool, evict_pulled_first)
    scheduler.build_connector_meta()  # the next step
    assert queue_labels(pool)[0] == "-"  # the output block, never cached, still goes first
    assert pool.get_new_blocks(3)[0] is blocks[5]
    remaining = queue_labels(pool)
    assert not set(evicted) & set(remaining) and len(remaining) == 6
    assert set(remaining) == ({"own-0", "own-1", "own-2", "pulled-0", "pulled-1", "pulled-2", "pulled-3",
                               "pulled-4"} - set(evicted))


def test_a_pulled_block_in_use_again_or_reused_is_left_where_it_is():
    pool = new_pool(10)
    scheduler, own, pulled = finish_a_pull(pool, True)
    pool.touch([pulled[0]])  # a local request hits the pulled prompt's head before the next step
    pool.free_block_queue.remove(pulled[1])  # and the block after it was reused for another prompt
    pulled[1].ref_cnt += 1
    pulled[1].reset_hash()
    scheduler.build_connector_meta()
    assert queue_labels(pool) == ["-", "pulled-4", "pulled-3", "pulled-2", "own-2", "own-1", "own-0"]
    assert pulled[0].ref_cnt == 1
