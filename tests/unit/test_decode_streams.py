"""The stall a prefill causes the streams decoding on its worker, measured from the tokens relayed."""

from __future__ import annotations

import pytest

from orchestrator.decode_streams import DecodeStreams, Stall

STEP = 0.02  # a stream's usual gap: one decode step


def decoding(streams: DecodeStreams, stream_id: str, times, worker_id: str = "d0") -> None:
    """``stream_id`` decoding on ``worker_id``, one token at each of ``times``."""
    streams.started(worker_id, stream_id, tpot_target=0.1, tokens_left=1000)
    for at in times:
        streams.token(worker_id, stream_id, 1, at)


def steady(start: float, end: float, gap: float = STEP) -> list[float]:
    return [round(start + n * gap, 6) for n in range(int(round((end - start) / gap)) + 1)]


def test_a_stream_that_waited_for_the_whole_prefill_is_stalled_for_it_less_its_usual_gap():
    streams = DecodeStreams()
    decoding(streams, "s1", steady(0.0, 1.0))  # its next token comes with the prefill's first
    assert streams.prefilled("d0", "p", dispatched_at=1.0, now=1.5) == Stall(pytest.approx(0.5 - STEP), 1)


def test_a_chunked_prefill_stalls_each_step_and_the_stream_is_charged_its_added_delay():
    streams = DecodeStreams()
    decoding(streams, "s1", steady(0.0, 1.0) + [1.1, 1.2, 1.3, 1.4, 1.5])  # a token per 100 ms chunk step
    stall = streams.prefilled("d0", "p", dispatched_at=1.0, now=1.5)
    assert stall.seconds == pytest.approx(0.5 - 5 * STEP)  # five tokens in the window, each one step late


def test_every_stream_on_the_worker_counts_and_one_too_new_for_a_usual_gap_takes_the_others():
    streams = DecodeStreams()
    decoding(streams, "old", steady(0.0, 1.0))
    decoding(streams, "new", [0.99])  # one token before the window: no gap of its own yet
    decoding(streams, "elsewhere", steady(0.0, 1.0), worker_id="d1")
    assert streams.prefilled("d0", "p", dispatched_at=1.0, now=1.5) == Stall(pytest.approx(0.48 + 0.48), 2)


def test_a_steady_stream_is_not_stalled():
    streams = DecodeStreams()
    decoding(streams, "s1", steady(0.0, 2.0))
    assert streams.prefilled("d0", "p", dispatched_at=1.0, now=1.5).seconds == pytest.approx(0.0, abs=1e-9)


def test_waiting_behind_an_earlier_prefill_is_that_prefills_stall_not_this_ones():
    streams = DecodeStreams()
    decoding(streams, "s1", steady(0.0, 1.0))
    first = streams.prefilled("d0", "p", dispatched_at=1.0, now=1.5)
    streams.token("d0", "s1", 1, 1.5)
    second = streams.prefilled("d0", "p", dispatched_at=1.2, now=1.7)  # queued behind the first: runs 1.5-1.7
    assert first.seconds == pytest.approx(0.48) and second.seconds == pytest.approx(0.18)


def test_nothing_is_measured_without_a_stream_decoding_there():
    streams = DecodeStreams()
    assert streams.prefilled("d0", "p", dispatched_at=1.0, now=1.5) is None
    decoding(streams, "gone", steady(0.0, 1.0))
    streams.ended("d0", "gone")
    streams.started("d0", "pulling", tpot_target=0.1, tokens_left=10)  # no token from d0 yet
    assert streams.prefilled("d0", "p", dispatched_at=1.6, now=2.0) is None


def test_under_steady_load_the_usual_gap_is_the_workers_quiet_step_not_the_streams_stalled_ones():
    streams = DecodeStreams()
    decoding(streams, "earlier", steady(0.0, 1.0))  # 50 quiet steps of 20 ms
    streams.ended("d0", "earlier")
    streams.prefill_dispatched("d0", "a")
    decoding(streams, "s1", [1.0, 1.5, 2.0, 2.5, 3.0])  # every gap of its life stalled by prompt a
    first = streams.prefilled("d0", "a", dispatched_at=1.0, now=3.0)
    streams.prefill_dispatched("d0", "b")
    for at in (3.5, 4.0):
        streams.token("d0", "s1", 1, at)
    second = streams.prefilled("d0", "b", dispatched_at=3.0, now=4.0)
    # Its own gaps (all 0.5 s) would call a 0.5 s gap usual and measure nothing.
    assert first == Stall(pytest.approx(4 * (0.5 - STEP)), 1)
    assert second == Stall(pytest.approx(2 * (0.5 - STEP)), 1)
    assert streams.quiet_gap("d0") == pytest.approx(STEP)


def test_gaps_beside_a_prefill_in_flight_or_ending_inside_them_are_not_quiet():
    streams = DecodeStreams()
    decoding(streams, "s1", steady(0.0, 0.1))  # 5 quiet gaps
    streams.prefill_dispatched("d0", "a")
    streams.token("d0", "s1", 1, 0.6)  # beside a: not quiet
    streams.prefilled("d0", "a", dispatched_at=0.1, now=0.9)
    streams.token("d0", "s1", 1, 1.0)  # a ended inside this gap: not quiet
    assert streams.quiet_gap("d0") == pytest.approx(STEP)
    for at in (1.1, 1.2, 1.3, 1.4, 1.5, 1.6):  # quiet again, at a slower step
        streams.token("d0", "s1", 1, at)
    assert streams.quiet_gap("d0") == pytest.approx(0.1)  # the median of 5 x 20 ms and 6 x 100 ms


def test_a_prefill_dropped_before_its_first_token_ends_the_busy_time_and_no_quiet_gap_means_the_old_rule():
    streams = DecodeStreams()
    streams.prefill_dispatched("d0", "a")
    decoding(streams, "s1", [0.0, 0.5, 1.0])
    assert streams.quiet_gap("d0") is None
    streams.prefill_dropped("d0", "a", now=1.0)
    streams.prefill_dropped("d0", "a", now=5.0)  # once only
    for at in (1.02, 1.04, 1.06):
        streams.token("d0", "s1", 1, at)
    assert streams.quiet_gap("d0") == pytest.approx(STEP)
    # Before any quiet gap, a stream's own gaps set the usual one (here 0.5 s: nothing measured).
    other = DecodeStreams()
    other.prefill_dispatched("d0", "a")
    decoding(other, "s1", [0.0, 0.5, 1.0, 1.5])
    assert other.prefilled("d0", "a", dispatched_at=1.0, now=1.5) == Stall(pytest.approx(0.0), 1)
