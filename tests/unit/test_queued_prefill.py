"""What a worker reports as its queued prefill: each waiting prompt less what its engine
will not compute (a pull, or leading blocks resident in its prefix cache)."""

from __future__ import annotations

import pytest

from foundation import kv_events, wire
from worker.queued_prefill import QueuedPrompt, head_prompt_age, queued_prefill, tokens_to_compute
from worker.resident import PrefixProgress, ResidentBlocks

BLOCK = 4
SALT = "tenant-a"
PROMPT = list(range(100, 118))  # 4 full blocks and 2 tokens


def stored(hashes, parent, tokens, salt=None):
    extra = [[salt]] if salt is not None else None
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                 block_size=BLOCK, extra_keys=extra)


def resident_with(*events) -> ResidentBlocks:
    resident = ResidentBlocks()
    for seq, event in enumerate(events):
        resident.apply(seq, kv_events.KVEventBatch(ts=0.0, events=[event]))
    return resident


def first_blocks(count: int, salt=None):
    """The prompt's first ``count`` blocks, stored in one event, engine hashes 1..count."""
    return stored(list(range(1, count + 1)), None, PROMPT[:count * BLOCK], salt)


def generate(prompt=PROMPT, salt=None, pulled=None) -> wire.GenerateRequest:
    source = None if pulled is None else wire.PullSource(handle="h" * 32, address="tcp://p:1",
                                                         num_tokens=pulled, block_size=BLOCK)
    return wire.GenerateRequest(request_id="r", prompt_token_ids=list(prompt), cache_salt=salt, pull_from=source)


def test_leading_resident_blocks_are_matched_by_tokens_and_chain():
    resident = resident_with(first_blocks(3))
    assert resident.cached_prefix_tokens(PROMPT, None) == 12
    assert resident.cached_prefix_tokens(PROMPT[:9], None) == 8  # only full blocks of the prompt
    assert resident.cached_prefix_tokens([0] + PROMPT[1:], None) == 0  # the first block differs


def test_a_block_under_another_parent_does_not_match():
    # Block 2's tokens stored as the child of something else: the chain breaks after block 1.
    resident = resident_with(stored([1], None, PROMPT[:4]), stored([9], 77, PROMPT[4:8]))
    assert resident.cached_prefix_tokens(PROMPT, None) == 4


def test_the_cache_salt_separates_namespaces():
    resident = resident_with(first_blocks(2, salt=SALT))
    assert resident.cached_prefix_tokens(PROMPT, SALT) == 8
    assert resident.cached_prefix_tokens(PROMPT, None) == 0
    assert resident.cached_prefix_tokens(PROMPT, "tenant-b") == 0


def test_removed_and_cleared_blocks_stop_matching():
    resident = resident_with(first_blocks(3), kv_events.BlockRemoved(block_hashes=[2]))
    assert resident.cached_prefix_tokens(PROMPT, None) == 4
    resident.apply(5, kv_events.KVEventBatch(ts=0.0, events=[kv_events.AllBlocksCleared()]))
    assert resident.cached_prefix_tokens(PROMPT, None) == 0
    assert resident.blocks == {}


def test_a_block_stored_again_keeps_its_place_and_matches():
    resident = resident_with(first_blocks(2), first_blocks(1))
    assert list(resident.blocks) == [1, 2]  # parents stay before children in snapshots
    assert resident.cached_prefix_tokens(PROMPT, None) == 8


def test_progress_resumes_where_the_last_walk_stopped_and_restarts_when_its_block_goes():
    resident = resident_with(first_blocks(2))
    progress = PrefixProgress()
    assert resident.cached_prefix_tokens(PROMPT, None, progress) == 8
    assert (progress.depth, progress.engine_hash) == (2, 2)
    resident.apply(1, kv_events.KVEventBatch(ts=0.0, events=[stored([3], 2, PROMPT[8:12])]))
    assert resident.cached_prefix_tokens(PROMPT, None, progress) == 12
    resident.apply(2, kv_events.KVEventBatch(ts=0.0, events=[kv_events.BlockRemoved(block_hashes=[3])]))
    assert resident.cached_prefix_tokens(PROMPT, None, progress) == 8


def test_no_events_yet_means_nothing_is_cached():
    assert ResidentBlocks().cached_prefix_tokens(PROMPT, None) == 0


@pytest.mark.parametrize("prompt_tokens, pulled, cached, expected", [
    (18, None, 0, 18),  # cold: the whole prompt
    (18, None, 12, 6),  # a hit: only what follows it
    (16, None, 16, 1),  # a full hit still recomputes the last token
    (18, 17, 12, 1),  # pulled beyond what is cached
    (18, 4, 12, 6),  # cached beyond what is pulled
])
def test_tokens_to_compute(prompt_tokens, pulled, cached, expected):
    assert tokens_to_compute(generate(PROMPT[:prompt_tokens], pulled=pulled), cached) == expected


def test_a_queued_prompt_shrinks_as_its_prefill_is_stored():
    # A long prefill in progress: vLLM publishes each chunk's blocks after its step.
    resident = ResidentBlocks()
    waiting = {"leader": QueuedPrompt(generate(salt=SALT)), "other": QueuedPrompt(generate(list(range(7))))}
    assert queued_prefill(waiting, resident) == {"leader": 18, "other": 7}
    resident.apply(0, kv_events.KVEventBatch(ts=0.0, events=[first_blocks(2, salt=SALT)]))
    assert queued_prefill(waiting, resident) == {"leader": 10, "other": 7}
    resident.apply(1, kv_events.KVEventBatch(ts=0.0, events=[stored([3, 4], 2, PROMPT[8:16])]))
    assert queued_prefill(waiting, resident) == {"leader": 2, "other": 7}


def test_a_warm_prompt_behind_a_cold_one_counts_only_its_new_tokens():
    resident = resident_with(first_blocks(4))
    follower = QueuedPrompt(generate(PROMPT + [7, 7, 7]))
    assert follower.tokens_left(resident) == 5


def test_the_oldest_prompt_s_age_counts_from_the_engine_s_last_step_or_its_arrival():
    oldest = QueuedPrompt(generate(), accepted_at=100.0)
    later = QueuedPrompt(generate(), accepted_at=101.0)
    prompts = {"a": oldest, "b": later}
    assert head_prompt_age(prompts, last_step_end=90.0, now=103.0) == 3.0  # an idle engine took it at once
    assert head_prompt_age(prompts, last_step_end=102.5, now=103.0) == 0.5  # its listing changed at 102.5
    assert head_prompt_age({}, last_step_end=102.5, now=103.0) == 0.0
