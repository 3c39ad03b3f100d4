"""LoadLedger: a stale heartbeat corrected by what this orchestrator sent and saw finish."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.load_ledger import LoadLedger, QueuedWork

IDLE = QueuedWork(num_waiting=0, num_queued_prefill_tokens=0)


@pytest.fixture
def ledger() -> LoadLedger:
    return LoadLedger()


def test_unknown_worker_keeps_its_report(ledger):
    report = QueuedWork(num_waiting=2, num_queued_prefill_tokens=900)
    assert ledger.queued("w1", report, 0.0) == report


def test_dispatch_not_yet_in_a_heartbeat_counts(ledger):
    ledger.dispatched("w1", "r1", 428, 0.0)
    assert ledger.queued("w1", IDLE, 0.0) == QueuedWork(1, 428)


def test_finished_prefill_still_in_the_last_heartbeat_is_subtracted(ledger):
    # The situation that made a warm worker look busy: the heartbeat sent while r1 was
    # queued arrives after r1's first token.
    ledger.dispatched("w1", "r1", 428, 0.0)
    ledger.prefilled("w1", "r1", 0.0)
    assert ledger.queued("w1", QueuedWork(1, 428), 0.0) == IDLE


def test_a_new_heartbeat_ends_the_correction(ledger):
    ledger.dispatched("w1", "r1", 428, 0.0)
    ledger.prefilled("w1", "r1", 0.0)
    ledger.heartbeat("w1")
    # Whatever the worker reports now is newer than r1's finish: other replicas' work.
    assert ledger.queued("w1", QueuedWork(1, 300), 0.0) == QueuedWork(1, 300)


def test_other_replicas_work_is_never_hidden(ledger):
    ledger.dispatched("w1", "r1", 100, 0.0)
    ledger.prefilled("w1", "r1", 0.0)
    assert ledger.queued("w1", QueuedWork(3, 2100), 0.0) == QueuedWork(2, 2000)


def test_pending_is_a_floor_and_prefilled_is_idempotent(ledger):
    ledger.dispatched("w1", "r1", 500, 0.0)
    ledger.dispatched("w1", "r2", 200, 0.0)
    ledger.prefilled("w1", "r1", 0.0)
    ledger.prefilled("w1", "r1", 0.0)  # the first token and the stream's end both report it
    ledger.prefilled("w1", "never-sent", 0.0)
    assert ledger.queued("w1", QueuedWork(2, 700), 0.0) == QueuedWork(1, 200)
    assert ledger.queued("w1", IDLE, 0.0) == QueuedWork(1, 200)


def test_forget_drops_everything_of_a_worker(ledger):
    ledger.dispatched("w1", "r1", 500, 0.0)
    ledger.forget("w1")
    ledger.prefilled("w1", "r1", 0.0)
    assert ledger.queued("w1", IDLE, 0.0) == IDLE


def test_negative_prefill_tokens_count_as_zero(ledger):
    ledger.dispatched("w1", "r1", -3, 0.0)
    assert ledger.queued("w1", IDLE, 0.0) == QueuedWork(1, 0)


# ---------------------------------------------------------------- decode room


def test_blocks_reserved_since_the_heartbeat_are_not_free():
    ledger = LoadLedger()
    ledger.reserved("d1", "r1", 12)
    assert ledger.free_blocks("d1", reported_free=40, total=91) == 28


def test_a_heartbeat_takes_over_the_reservation():
    ledger = LoadLedger()
    ledger.reserved("d1", "r1", 12)
    ledger.heartbeat("d1")
    assert ledger.free_blocks("d1", reported_free=28, total=91) == 28


def test_blocks_of_a_request_that_ended_after_the_heartbeat_are_free_again():
    # The 429s this prevents: the heartbeat still shows a finished request's blocks as used.
    ledger = LoadLedger()
    ledger.reserved("d1", "r1", 12)
    ledger.heartbeat("d1")
    ledger.released("d1", "r1")
    assert ledger.free_blocks("d1", reported_free=7, total=91) == 19
    ledger.heartbeat("d1")
    assert ledger.free_blocks("d1", reported_free=19, total=91) == 19


def test_a_request_that_ended_before_any_heartbeat_saw_it_changes_nothing():
    ledger = LoadLedger()
    ledger.reserved("d1", "r1", 12)
    ledger.released("d1", "r1")
    ledger.released("d1", "r1")
    assert ledger.free_blocks("d1", reported_free=40, total=91) == 40


def test_free_blocks_stay_within_the_cache():
    ledger = LoadLedger()
    ledger.reserved("d1", "r1", 50)
    assert ledger.free_blocks("d1", reported_free=10, total=91) == 0
    ledger.heartbeat("d1")
    ledger.released("d1", "r1")
    assert ledger.free_blocks("d1", reported_free=80, total=91) == 91
    assert ledger.free_blocks("unknown", reported_free=5, total=91) == 5


def test_a_request_that_ended_after_the_heartbeat_no_longer_runs():
    # A stale count made a cold decode worker look busy, so a LOCAL prefill there was
    # charged the slowdown of a decode that had already ended.
    ledger = LoadLedger()
    ledger.reserved("d1", "r1", 12)
    ledger.reserved("d1", "r2", 12)
    ledger.heartbeat("d1")
    ledger.released("d1", "r1")
    assert ledger.running("d1", reported_running=2) == 1
    ledger.heartbeat("d1")
    assert ledger.running("d1", reported_running=1) == 1


def test_running_requests_never_go_below_zero():
    ledger = LoadLedger()
    ledger.reserved("d1", "r1", 12)
    ledger.heartbeat("d1")
    ledger.released("d1", "r1")
    assert ledger.running("d1", reported_running=0) == 0
    assert ledger.running("unknown", reported_running=3) == 3


# ---------------------------------------------------------------- workers that list their queue


def listed(**tokens: int) -> QueuedWork:
    return QueuedWork(num_waiting=len(tokens), num_queued_prefill_tokens=sum(tokens.values()), per_request=tokens)


def test_a_listed_queue_is_read_as_the_worker_reports_it(ledger):
    # r1 is half prefilled: the worker lists what is left of it, which is less than the
    # prompt this orchestrator sent; the listing wins over the ledger's own count.
    ledger.dispatched("w1", "r1", 4000, 0.0)
    assert ledger.queued("w1", listed(r1=1500), 0.0).num_queued_prefill_tokens == 1500


def test_own_requests_the_listing_lacks_yet_count_in_full(ledger):
    ledger.dispatched("w1", "r1", 4000, 0.0)
    ledger.dispatched("w1", "r2", 300, 0.0)  # sent after the worker made its heartbeat
    assert ledger.queued("w1", listed(r1=1500), 0.0).num_queued_prefill_tokens == 1800


def test_listed_requests_seen_prefilled_since_drop_out(ledger):
    ledger.dispatched("w1", "r1", 4000, 0.0)
    ledger.prefilled("w1", "r1", 0.0)
    work = ledger.queued("w1", listed(r1=1500, other=700), 0.0)  # "other": another replica's request
    assert work.num_queued_prefill_tokens == 700
    ledger.heartbeat("w1")
    assert ledger.queued("w1", listed(other=650), 0.0).num_queued_prefill_tokens == 650


def test_a_listing_is_kept_for_the_planner(ledger):
    ledger.dispatched("w1", "r1", 10, 0.0)
    assert ledger.queued("w1", listed(r1=4), 0.0).per_request == {"r1": 4}


def test_the_planner_gets_the_listing_corrected_prompt_by_prompt(ledger):
    # The planner prices a worker that shares its steps prompt by prompt, so the listing
    # it gets must be the corrected one: finished requests gone, unlisted own ones added.
    ledger.dispatched("w1", "r1", 4000, 0.0)
    ledger.dispatched("w1", "r2", 900, 0.0)
    ledger.dispatched("w1", "r3", 300, 0.0)  # sent after the worker made its heartbeat
    ledger.prefilled("w1", "r2", 0.0)
    work = ledger.queued("w1", listed(r1=1500, r2=120, other=700), 0.0)
    assert work.per_request == {"r1": 1500, "other": 700, "r3": 300}
    assert work.num_queued_prefill_tokens == 2500


def test_a_worker_that_reports_only_a_total_lists_nothing(ledger):
    ledger.dispatched("w1", "r1", 4000, 0.0)
    assert ledger.queued("w1", QueuedWork(2, 5000), 0.0).per_request is None


# ---------------------------------------------------------------- how long the oldest prompt has computed


def test_the_oldest_prompt_s_reported_age_stands_while_the_heartbeat_lists_it_first(ledger):
    ledger.dispatched("w1", "r1", 1200, now=10.0)
    reported = replace(listed(r1=1200, r2=300), head_age=2.5)
    assert ledger.queued("w1", reported, now=13.0).head_age == 2.5


def test_a_prompt_behind_one_that_finished_since_the_heartbeat_started_when_it_finished(ledger):
    ledger.dispatched("w1", "r1", 1200, now=10.0)
    ledger.dispatched("w1", "r2", 300, now=11.0)
    ledger.prefilled("w1", "r1", now=14.0)
    work = ledger.queued("w1", replace(listed(r1=1200, r2=300), head_age=3.0), now=14.5)
    assert list(work.per_request) == ["r2"] and work.head_age == pytest.approx(0.5)


def test_a_prompt_sent_since_the_heartbeat_started_when_it_was_sent(ledger):
    ledger.dispatched("w1", "r1", 1200, now=20.0)
    assert ledger.queued("w1", listed(), now=20.75).head_age == pytest.approx(0.75)


def test_an_empty_queue_has_no_age(ledger):
    ledger.dispatched("w1", "r1", 1200, now=20.0)
    ledger.prefilled("w1", "r1", now=21.0)
    assert ledger.queued("w1", replace(listed(r1=1200), head_age=0.9), now=21.5).head_age == 0.0


def test_a_heartbeat_is_current_until_this_orchestrator_sends_or_sees_something_it_does_not_show(ledger):
    listed = QueuedWork(2, 900, per_request={"other-1": 500, "other-2": 400}, head_age=0.3)
    assert ledger.heartbeat_is_current("w1")
    ledger.dispatched("w1", "r1", 428, 0.0)
    assert not ledger.heartbeat_is_current("w1")
    ledger.prefilled("w1", "r1", 1.0)
    assert not ledger.heartbeat_is_current("w1")  # the heartbeat may still list r1
    ledger.heartbeat("w1")
    assert ledger.heartbeat_is_current("w1") and ledger.queued("w1", listed, 2.0) is listed
    ledger.reserved("w1", "r1", 40)
    ledger.heartbeat("w1")
    ledger.released("w1", "r1")
    assert not ledger.heartbeat_is_current("w1")  # it ended after the heartbeat counted it running
    ledger.heartbeat("w1")
    assert ledger.heartbeat_is_current("w1")
