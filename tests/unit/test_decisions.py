"""The decision log: one record per placement, bounded, retrievable by response."""

from __future__ import annotations

import pytest

from foundation import wire
from orchestrator.decisions import DecisionLog, DecisionRecord
from orchestrator.disagg import HandoffRecord


def record(response_id: str, request_id: str, choice_index: int = 0, tenant: str = "anonymous") -> DecisionRecord:
    return DecisionRecord(response_id=response_id, choice_index=choice_index, request_id=request_id,
                          policy="cache_aware", prompt_tokens=300, block_size=128, predicted_reused_tokens=0,
                          reason="test", chosen=None, alternatives=[], tenant=tenant)


def test_a_moved_request_keeps_the_record_of_every_placement_in_order():
    log = DecisionLog()
    first, moved = record("chatcmpl-a", "req"), record("chatcmpl-a", "req-m1")
    first.actual.error = "timeout: worker sent nothing"
    log.add(first)
    log.add(record("chatcmpl-b", "other"))
    log.add(moved)
    assert log.by_response("chatcmpl-a") == [first, moved]
    assert log.by_response("chatcmpl-a")[0].actual.error.startswith("timeout")
    assert [r.request_id for r in log.recent(10)] == ["req-m1", "other", "req"]


def test_choices_of_one_response_are_separate_records():
    log = DecisionLog()
    log.add(record("chatcmpl-n", "req-0", choice_index=0))
    log.add(record("chatcmpl-n", "req-1", choice_index=1))
    assert [r.choice_index for r in log.by_response("chatcmpl-n")] == [0, 1]


def test_the_oldest_records_age_out_past_capacity():
    log = DecisionLog(capacity=3)
    for number in range(5):
        log.add(record(f"chatcmpl-{number}", f"req-{number}"))
    assert log.by_response("chatcmpl-0") == [] and log.by_response("chatcmpl-1") == []
    assert [r.response_id for r in log.recent(10)] == ["chatcmpl-4", "chatcmpl-3", "chatcmpl-2"]


def test_a_tenant_reads_and_lists_its_own_records_only():
    log = DecisionLog()
    for number in range(6):
        log.add(record(f"cmpl-{number}", f"req-{number}", tenant="team-a" if number % 2 else "team-b"))
    assert [r.response_id for r in log.recent(2, tenant="team-a")] == ["cmpl-5", "cmpl-3"]
    assert [r.response_id for r in log.recent(10, tenant="team-b")] == ["cmpl-4", "cmpl-2", "cmpl-0"]
    assert log.recent(10, tenant="team-c") == []
    assert log.by_response("cmpl-1", tenant="team-b") == [] and log.by_response("cmpl-1", tenant="team-a")
    # No tenant (an admin): everyone's.
    assert [r.response_id for r in log.recent(3)] == ["cmpl-5", "cmpl-4", "cmpl-3"]
    assert log.by_response("cmpl-1")[0].to_dict()["tenant"] == "team-a"


def test_the_actual_outcome_is_read_from_the_hand_off_tier_tokens_included():
    handoff = HandoffRecord("req", prompt_tokens=400, prefill_cached_tokens=384, prefill_tier_tokens=320,
                            first_token_at=10.5, second_token_at=10.6,
                            transfer=wire.PullRecord("req-1", "tcp://a", num_bytes=4096, seconds=0.02, ok=True))
    actual = record("chatcmpl-t", "req").actual
    actual.observe(handoff, arrived_at=10.0, now=12.0)
    assert (actual.reused_tokens, actual.tier_tokens) == (384, 320)
    assert (actual.ttft, actual.second_token_gap, actual.e2e) == (0.5, pytest.approx(0.1), 2.0)
    assert (actual.transfer_bytes, actual.transfer_seconds) == (4096, 0.02)


def test_a_request_without_a_first_token_reports_no_reuse_and_a_failed_pull_no_transfer():
    handoff = HandoffRecord("req", prefill_cached_tokens=384,
                            transfer=wire.PullRecord("req-1", "tcp://a", num_bytes=4096, seconds=0.02, ok=False))
    actual = record("chatcmpl-u", "req").actual
    actual.observe(handoff, arrived_at=10.0, now=12.0)
    assert (actual.reused_tokens, actual.tier_tokens, actual.ttft, actual.transfer_bytes) == (None, None, None, None)
