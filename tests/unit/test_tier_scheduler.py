"""The scheduler half of the connector with a node store (transfer.tier_scheduler), driven
with fake vLLM requests and a fake store: lookups beyond the local hit, loads planned into
vLLM's blocks, write-through of exactly the blocks a request computed itself, tier tokens
in the output, and a failed load that counts as none."""

from __future__ import annotations

import concurrent.futures

from vllm.v1.request import RequestStatus

from foundation import identity
from tests.unit.connector_requests import (
    BLOCK_SIZE,
    PROMPT,
    consumer_request,
    make_blocks,
    make_request,
    produce,
)
from transfer.connector_scheduler import ConnectorScheduler
from transfer.metadata import TierLoad, TierSave
from transfer.request_params import PARAMS_KEY
from transfer.settings import ConnectorSettings
from transfer.tier_scheduler import TierScheduler

SALT = "tenant-a"
KEYS = [h.to_bytes(16, "little") for h in identity.block_hashes(PROMPT, BLOCK_SIZE, SALT)]  # 5 full blocks


class FakeStore:
    """Holds some keys; counts the lookups it answered."""

    def __init__(self, held=(), available=True):
        self.held = set(held)
        self.available = available
        self.lookups: list[list[bytes]] = []

    def leading(self, keys: list[bytes]) -> int:
        self.lookups.append(keys)
        count = 0
        for key in keys:
            if key not in self.held:
                break
            count += 1
        return count


class InlineExecutor:
    """Runs each lookup as it is submitted: the answer is in at the first ask
    (tests/unit/test_tier_lookups.py covers the answer on the way)."""

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        future.set_result(fn(*args))
        return future


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scheduler_with(store: FakeStore, clock: Clock | None = None) -> ConnectorScheduler:
    return ConnectorScheduler(ConnectorSettings(transfer_address="tcp://127.0.0.1:1"), BLOCK_SIZE,
                              tier=TierScheduler(store, BLOCK_SIZE, InlineExecutor(), clock=clock or Clock()))


def finished(request, num_computed_tokens: int):
    request.num_computed_tokens = num_computed_tokens
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return request


def test_the_store_is_asked_only_for_blocks_beyond_the_local_hit_and_once():
    store = FakeStore(held=KEYS)
    scheduler = scheduler_with(store)
    request = make_request(cache_salt=SALT)
    assert scheduler.get_num_new_matched_tokens(request, 8) == (12, True)  # blocks 2, 3, 4
    assert scheduler.get_num_new_matched_tokens(request, 8) == (12, True)
    assert store.lookups == [KEYS[2:5]]


def test_the_last_prompt_token_is_always_computed():
    prompt = PROMPT[:20]  # 5 full blocks, but the fifth holds the last token
    keys = [h.to_bytes(16, "little") for h in identity.block_hashes(prompt, BLOCK_SIZE, SALT)]
    store = FakeStore(held=keys)
    assert scheduler_with(store).get_num_new_matched_tokens(make_request(prompt=prompt, cache_salt=SALT), 0) \
        == (16, True)
    assert store.lookups == [keys[:4]]


def test_another_namespace_finds_nothing():
    store = FakeStore(held=KEYS)
    assert scheduler_with(store).get_num_new_matched_tokens(make_request(cache_salt="tenant-b"), 0) == (0, False)


def test_a_store_left_alone_is_not_asked():
    store = FakeStore(held=KEYS, available=False)
    assert scheduler_with(store).get_num_new_matched_tokens(make_request(cache_salt=SALT), 0) == (0, False)
    assert store.lookups == []


def test_a_tier_hit_is_loaded_into_the_allocated_blocks_and_reported_at_the_end():
    clock = Clock()
    scheduler = scheduler_with(FakeStore(held=KEYS[:3]), clock)
    request = make_request(cache_salt=SALT)
    assert scheduler.get_num_new_matched_tokens(request, 4) == (8, True)
    clock.now += 0.25
    scheduler.update_state_after_alloc(request, make_blocks(1, [10, 11, 12, 13, 14, 15]), 8)
    metadata = scheduler.build_connector_meta()
    assert metadata.tier_loads == [TierLoad(request.request_id, tuple(KEYS[1:3]), (11, 12))]
    assert metadata.loads == []
    clock.now += 0.5
    scheduler.loads_done({request.request_id, "another-request"})
    clock.now += 3.0  # the prefill and decode that follow are not the tier's time
    # vLLM allocates the rest once the load is done: nothing more is planned then.
    scheduler.update_state_after_alloc(request, make_blocks(3, [10, 11, 12, 13, 14, 15]), 0)
    delay_free, params = scheduler.request_finished(finished(request, 21), [10, 11, 12, 13, 14, 15])
    # From the first lookup to the load's end.
    assert (delay_free, params) == (False, {PARAMS_KEY: {"tier_tokens": 8, "tier_seconds": 0.75}})
    # Written through: only the blocks computed here (3 and 4), not the local hit or the tier's.
    assert scheduler.build_connector_meta().tier_saves == [TierSave(request.request_id, tuple(KEYS[3:5]), (13, 14))]


def test_a_failed_load_counts_no_tier_tokens_and_writes_the_recomputed_blocks():
    scheduler = scheduler_with(FakeStore(held=KEYS))
    request = make_request(cache_salt=SALT)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(0, [20, 21, 22, 23, 24, 25]), 20)
    scheduler.loads_failed({request.request_id})
    delay_free, params = scheduler.request_finished(finished(request, 21), [20, 21, 22, 23, 24, 25])
    assert (delay_free, params) == (False, None)
    assert scheduler.build_connector_meta().tier_saves == [
        TierSave(request.request_id, tuple(KEYS), (20, 21, 22, 23, 24))]


def test_a_cold_request_writes_every_full_block_through_and_a_partial_one_never():
    scheduler = scheduler_with(FakeStore())
    request = make_request(cache_salt=SALT)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    # vLLM hashes the blocks a step will fill as it allocates them: they are no local hit.
    scheduler.update_state_after_alloc(request, make_blocks(5, [1, 2, 3, 4, 5, 6]), 0)
    scheduler.request_finished(finished(request, 19), [1, 2, 3, 4, 5])  # 4 full blocks computed
    assert scheduler.build_connector_meta().tier_saves == [TierSave(request.request_id, tuple(KEYS[:4]),
                                                                    (1, 2, 3, 4))]


def test_a_producer_writes_through_and_still_grants_its_lease():
    store = FakeStore()
    scheduler = scheduler_with(store)
    request = make_request("prod-1", PROMPT, {PARAMS_KEY: {"hold_blocks": True}}, SALT)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(5, [30, 31, 32, 33, 34, 35]), 0)
    delay_free, params = scheduler.request_finished(finished(request, 21), [30, 31, 32, 33, 34, 35])
    assert delay_free is True and "pull_source" in params[PARAMS_KEY] and "tier_tokens" not in params[PARAMS_KEY]
    metadata = scheduler.build_connector_meta()
    assert len(metadata.grants) == 1
    assert metadata.tier_saves == [TierSave("prod-1", tuple(KEYS), (30, 31, 32, 33, 34))]


def test_pulled_blocks_are_not_written_through_and_the_store_is_not_asked():
    source, _ = produce(cache_salt=SALT)
    store = FakeStore(held=KEYS)
    scheduler = scheduler_with(store)
    request = consumer_request(source, cache_salt=SALT)
    count, _ = scheduler.get_num_new_matched_tokens(request, 4)
    assert count == 16 and store.lookups == []  # the pull source decides, not the tier
    scheduler.update_state_after_alloc(request, make_blocks(1, [40, 41, 42, 43, 44, 45]), count)
    scheduler.request_finished(finished(request, 21), [40, 41, 42, 43, 44, 45])
    assert scheduler.build_connector_meta().tier_saves == []  # block 0 was local, 1-4 pulled


def test_vllm_is_told_not_yet_while_the_stores_answer_is_on_the_way():
    answers = concurrent.futures.Future()

    class PendingExecutor:
        def submit(self, fn, *args) -> concurrent.futures.Future:
            return answers

    scheduler = ConnectorScheduler(ConnectorSettings(transfer_address="tcp://127.0.0.1:1"), BLOCK_SIZE,
                                   tier=TierScheduler(FakeStore(held=KEYS), BLOCK_SIZE, PendingExecutor()))
    request = make_request(cache_salt=SALT)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    answers.set_result(9)  # more than the lookup asked about: capped at its 5 loadable blocks
    assert scheduler.get_num_new_matched_tokens(request, 0) == (20, True)
