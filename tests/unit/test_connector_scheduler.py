"""The scheduler half of the kvroute connector, driven with fake vLLM requests and
block lists: producers grant leases, consumers plan delta loads or release."""

from __future__ import annotations

import re

import pytest
from vllm.v1.request import RequestStatus

from foundation import wire
from tests.unit.connector_requests import (
    BLOCK_SIZE,
    PRODUCER_ADDRESS,
    PROMPT,
    P,
    consumer_request,
    make_blocks,
    make_request,
    new_scheduler,
    produce,
)
from transfer.metadata import LeaseGrant, LoadSpec
from transfer.request_params import PARAMS_KEY, prompt_digest

# ---------------------------------------------------------------- producer


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED])
def test_producer_grants_a_lease_when_finished_normally(status):
    scheduler = new_scheduler()
    request = make_request("prod-1", PROMPT, {PARAMS_KEY: {"hold_blocks": True}}, cache_salt="tenant-a",
                           num_computed_tokens=len(PROMPT), status=status)
    delay_free, params = scheduler.request_finished(request, [30, 31, 32, 33, 34, 35])

    assert delay_free is True
    assert set(params) == {PARAMS_KEY}
    source = params[PARAMS_KEY]["pull_source"]
    assert isinstance(source, dict)
    handle = source["handle"]
    assert re.fullmatch(r"[0-9a-f]{32}", handle), handle  # 128 random bits
    assert source == {"handle": handle, "address": PRODUCER_ADDRESS, "num_tokens": len(PROMPT),
                      "block_size": BLOCK_SIZE, "prompt_digest": prompt_digest(PROMPT, "tenant-a")}
    assert wire.from_dict(source, wire.PullSource).handle == handle

    metadata = scheduler.build_connector_meta()
    assert metadata.grants == [LeaseGrant("prod-1", handle, (30, 31, 32, 33, 34, 35), len(PROMPT))]
    assert metadata.loads == [] and metadata.releases == []


def test_handles_are_distinct():
    scheduler = new_scheduler()
    handles = set()
    for i in range(200):
        request = make_request(f"prod-{i}", PROMPT, {PARAMS_KEY: {"hold_blocks": True}},
                               num_computed_tokens=len(PROMPT), status=RequestStatus.FINISHED_STOPPED)
        _, params = scheduler.request_finished(request, [1])
        handles.add(params[PARAMS_KEY]["pull_source"]["handle"])
    assert len(handles) == 200
    assert len(scheduler.build_connector_meta().grants) == 200


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_IGNORED,
                                    RequestStatus.FINISHED_ERROR, RequestStatus.RUNNING,
                                    RequestStatus.PREEMPTED])
def test_producer_that_did_not_finish_normally_grants_nothing(status):
    scheduler = new_scheduler()
    request = make_request("prod-1", PROMPT, {PARAMS_KEY: {"hold_blocks": True}},
                           num_computed_tokens=len(PROMPT), status=status)
    assert scheduler.request_finished(request, [30, 31, 32]) == (False, None)
    assert scheduler.build_connector_meta().is_empty()


@pytest.mark.parametrize("params, block_ids", [
    pytest.param(None, [1, 2], id="no-params"),
    pytest.param({}, [1, 2], id="empty-params"),
    pytest.param({"other_connector": {"hold_blocks": True}}, [1, 2], id="other-key"),
    pytest.param({PARAMS_KEY: {}}, [1, 2], id="no-hold"),
    pytest.param({PARAMS_KEY: {"hold_blocks": False}}, [1, 2], id="hold-false"),
    pytest.param({PARAMS_KEY: {"hold_blocks": True}}, [], id="no-blocks"),
])
def test_no_lease_without_hold_blocks_or_blocks(params, block_ids):
    scheduler = new_scheduler()
    request = make_request("prod-1", PROMPT, params, num_computed_tokens=len(PROMPT),
                           status=RequestStatus.FINISHED_LENGTH_CAPPED)
    assert scheduler.request_finished(request, block_ids) == (False, None)
    assert scheduler.build_connector_meta().is_empty()


# ---------------------------------------------------------------- consumer: matching



@pytest.mark.parametrize("num_computed, expected", [
    pytest.param(0, (P, True), id="nothing-local"),
    pytest.param(8, (P - 8, True), id="two-blocks-local"),
    pytest.param(16, (P - 16, True), id="four-blocks-local"),
    pytest.param(P, (0, False), id="all-local"),
])
def test_consumer_matches_the_producers_tokens_beyond_the_local_hit(num_computed, expected):
    source, _ = produce()
    scheduler = new_scheduler("tcp://consumer:1")
    request = consumer_request(source, num_computed_tokens=num_computed)
    assert scheduler.get_num_new_matched_tokens(request, num_computed) == expected


def test_consumer_whose_prompt_extends_the_producers_loads_the_shared_prefix():
    producer_prompt = PROMPT[:13]
    source, _ = produce(prompt=producer_prompt, block_ids=(1, 2, 3, 4))
    scheduler = new_scheduler()
    request = consumer_request(source, prompt=PROMPT)  # 21 tokens starting with the 13
    assert scheduler.get_num_new_matched_tokens(request, 0) == (13, True)
    assert scheduler.get_num_new_matched_tokens(request, 4) == (9, True)


def _lookalike(prompt, position):
    changed = list(prompt)
    changed[position] += 1
    return changed


@pytest.mark.parametrize("prompt, cache_salt", [
    pytest.param(_lookalike(PROMPT, 0), None, id="first-token-differs"),
    pytest.param(_lookalike(PROMPT, 10), None, id="middle-token-differs"),
    pytest.param(_lookalike(PROMPT, len(PROMPT) - 1), None, id="last-token-differs"),
    pytest.param(list(reversed(PROMPT)), None, id="same-tokens-other-order"),
    pytest.param(PROMPT[:-1], None, id="shorter-prompt"),
    pytest.param(PROMPT[1:] + [7], None, id="shifted"),
    pytest.param(PROMPT, "tenant-b", id="other-salt"),
    pytest.param(PROMPT, None, id="no-salt"),
])
def test_lookalike_prompt_or_other_salt_never_loads(prompt, cache_salt):
    source, _ = produce(cache_salt="tenant-a")
    scheduler = new_scheduler()
    request = consumer_request(source, prompt=prompt, cache_salt=cache_salt)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)


def test_same_salt_and_prompt_loads():
    source, _ = produce(cache_salt="tenant-a")
    request = consumer_request(source, cache_salt="tenant-a")
    assert new_scheduler().get_num_new_matched_tokens(request, 0) == (P, True)


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda s: s | {"prompt_digest": ""}, id="no-digest"),
    pytest.param(lambda s: s | {"prompt_digest": "0" * 32}, id="wrong-digest"),
    pytest.param(lambda s: s | {"num_tokens": s["num_tokens"] - 1}, id="num-tokens-lies"),
    pytest.param(lambda s: {k: v for k, v in s.items() if k != "handle"}, id="malformed-no-handle"),
    pytest.param(lambda s: s | {"num_tokens": "21"}, id="malformed-type"),
])
def test_tampered_or_malformed_pull_from_never_loads(mutate):
    source, _ = produce()
    scheduler = new_scheduler()
    request = consumer_request(mutate(source))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.update_state_after_alloc(request, make_blocks(0, range(6)), 0)
    assert scheduler.build_connector_meta().loads == []


@pytest.mark.parametrize("params", [None, {}, {PARAMS_KEY: {}}, {PARAMS_KEY: {"hold_blocks": True}}])
def test_request_without_pull_from_is_not_external(params):
    scheduler = new_scheduler()
    request = make_request("plain", PROMPT, params)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.update_state_after_alloc(request, make_blocks(0, range(6)), 0)
    assert scheduler.request_finished(request, []) == (False, None)
    assert scheduler.build_connector_meta().is_empty()


def test_get_num_new_matched_tokens_is_side_effect_free():
    source, _ = produce()
    scheduler = new_scheduler()
    request = consumer_request(source)
    first = scheduler.get_num_new_matched_tokens(request, 8)
    second = scheduler.get_num_new_matched_tokens(request, 8)
    assert first == second == (P - 8, True)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (P, True)
    assert scheduler.build_connector_meta().is_empty()
    # Nothing was recorded either: an unallocated request that finishes is an abort.
    scheduler.request_finished(request, [])
    assert [reason for _, reason in scheduler.build_connector_meta().releases] == ["abort"]


# ---------------------------------------------------------------- consumer: allocation


@pytest.mark.parametrize("prompt_len, num_local_blocks, expected_remote", [
    # 21 tokens: 20 loadable; lease holds 6 blocks (positions 0..5).
    pytest.param(21, 0, (0, 1, 2, 3, 4), id="no-local"),
    pytest.param(21, 2, (2, 3, 4), id="two-local"),
    pytest.param(21, 4, (4,), id="four-local"),
    # 19 tokens: 18 loadable, the last loaded block is partial.
    pytest.param(19, 1, (1, 2, 3, 4), id="partial-last-block"),
    pytest.param(6, 0, (0, 1), id="short-prompt"),
])
def test_update_state_after_alloc_plans_a_delta_load(prompt_len, num_local_blocks, expected_remote):
    prompt = PROMPT[:prompt_len]
    num_lease_blocks = -(-prompt_len // BLOCK_SIZE)
    source, grant = produce(prompt=prompt, block_ids=range(50, 50 + num_lease_blocks))
    scheduler = new_scheduler()
    num_computed = num_local_blocks * BLOCK_SIZE
    request = consumer_request(source, prompt=prompt, num_computed_tokens=num_computed)
    num_external, load_async = scheduler.get_num_new_matched_tokens(request, num_computed)
    assert load_async is True
    assert num_computed + num_external == prompt_len - 1

    local_ids = [900 + i for i in range(num_lease_blocks)]  # the consumer's allocation for the whole prompt
    scheduler.update_state_after_alloc(request, make_blocks(num_local_blocks, local_ids), num_external)

    metadata = scheduler.build_connector_meta()
    assert metadata.grants == [] and metadata.releases == []
    expected_local = tuple(local_ids[i] for i in expected_remote)
    assert metadata.loads == [LoadSpec("cons-1", wire.from_dict(source, wire.PullSource), expected_remote,
                                       expected_local)]
    # Every planned remote position exists in the producer's lease.
    assert all(0 <= i < len(grant.block_ids) for i in expected_remote)


def test_full_local_hit_releases_the_lease():
    source, _ = produce()
    scheduler = new_scheduler()
    request = consumer_request(source, num_computed_tokens=P)
    assert scheduler.get_num_new_matched_tokens(request, P) == (0, False)
    scheduler.update_state_after_alloc(request, make_blocks(5, range(6)), 0)
    metadata = scheduler.build_connector_meta()
    assert metadata.loads == []
    assert metadata.releases == [(wire.from_dict(source, wire.PullSource), "local_hit")]
    # Finishing later queues nothing more: the lease was already given back.
    assert scheduler.request_finished(request, [0, 1, 2, 3, 4, 5]) == (False, None)
    assert scheduler.build_connector_meta().is_empty()


def test_allocation_is_planned_once():
    """A preempted and rescheduled consumer neither matches nor loads again."""
    source, _ = produce()
    scheduler = new_scheduler()
    request = consumer_request(source)
    scheduler.update_state_after_alloc(request, make_blocks(0, range(6)), P)
    assert len(scheduler.build_connector_meta().loads) == 1
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.update_state_after_alloc(request, make_blocks(0, range(6)), P)
    scheduler.update_state_after_alloc(request, make_blocks(0, range(6)), 0)
    assert scheduler.build_connector_meta().is_empty()


def test_finished_consumer_after_a_planned_load_queues_no_release():
    source, _ = produce()
    scheduler = new_scheduler()
    request = consumer_request(source)
    scheduler.update_state_after_alloc(request, make_blocks(0, range(6)), P)
    scheduler.build_connector_meta()
    request.status = RequestStatus.FINISHED_STOPPED
    assert scheduler.request_finished(request, list(range(6))) == (False, None)
    assert scheduler.build_connector_meta().is_empty()
    # Its id is forgotten: a new request reusing the id is a new consumer.
    again = consumer_request(source)
    assert scheduler.get_num_new_matched_tokens(again, 0) == (P, True)


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_IGNORED,
                                    RequestStatus.FINISHED_STOPPED])
def test_consumer_finished_before_allocation_releases_as_abort(status):
    source, _ = produce()
    scheduler = new_scheduler()
    request = consumer_request(source)
    request.status = status
    assert scheduler.request_finished(request, []) == (False, None)
    metadata = scheduler.build_connector_meta()
    assert metadata.releases == [(wire.from_dict(source, wire.PullSource), "abort")]
    assert metadata.loads == [] and metadata.grants == []


def test_build_connector_meta_drains():
    source, _ = produce()
    scheduler = new_scheduler()
    scheduler.update_state_after_alloc(consumer_request(source, "a"), make_blocks(0, range(6)), P)
    scheduler.update_state_after_alloc(consumer_request(source, "b"), make_blocks(5, range(6)), 0)
    scheduler.request_finished(consumer_request(source, "c"), [])
    producer_request = make_request("d", PROMPT, {PARAMS_KEY: {"hold_blocks": True}},
                                    num_computed_tokens=len(PROMPT), status=RequestStatus.FINISHED_STOPPED)
    scheduler.request_finished(producer_request, [7])

    first = scheduler.build_connector_meta()
    assert [load.request_id for load in first.loads] == ["a"]
    assert [reason for _, reason in first.releases] == ["local_hit", "abort"]
    assert [grant.request_id for grant in first.grants] == ["d"]
    assert not first.is_empty()

    second = scheduler.build_connector_meta()
    assert second.is_empty()
    assert second is not first
    assert (second.grants, second.loads, second.releases) == ([], [], [])
    # The first metadata object is not mutated by later work.
    scheduler.update_state_after_alloc(consumer_request(source, "e"), make_blocks(0, range(6)), P)
    assert [load.request_id for load in first.loads] == ["a"]


# ---------------------------------------------------------------- the digest


def test_prompt_digest_separates_salt_and_tokens():
    assert prompt_digest([1, 2, 3], None) == prompt_digest([1, 2, 3], "")
    assert prompt_digest([1, 2, 3], None) != prompt_digest([1, 2, 4], None)
    assert prompt_digest([1, 2, 3], "a") != prompt_digest([1, 2, 3], "b")
    assert prompt_digest([1, 2], None) != prompt_digest([1, 2, 0], None)
    assert prompt_digest([256], None) != prompt_digest([1, 0], None)
    assert re.fullmatch(r"[0-9a-f]{32}", prompt_digest([5], "x"))


@pytest.mark.parametrize("num_scheduled_tokens, idle", [(0, True), (1, False), (512, False)])
def test_a_step_that_computes_nothing_is_marked_idle(num_scheduled_tokens, idle):
    """The worker half waits for pulls in such steps instead of letting vLLM spin."""
    metadata = new_scheduler().build_connector_meta(num_scheduled_tokens)
    assert metadata.idle_step is idle
    assert metadata.is_empty() is not idle
