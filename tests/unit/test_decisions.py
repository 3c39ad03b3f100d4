"""The decision log: one record per placement, bounded, retrievable by response."""

from __future__ import annotations

from orchestrator.decisions import DecisionLog, DecisionRecord


def record(response_id: str, request_id: str, choice_index: int = 0) -> DecisionRecord:
    return DecisionRecord(response_id=response_id, choice_index=choice_index, request_id=request_id,
                          policy="cache_aware", prompt_tokens=300, block_size=128, predicted_reused_tokens=0,
                          reason="test", chosen=None, alternatives=[])


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
