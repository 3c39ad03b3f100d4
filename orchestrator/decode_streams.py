"""The streams each worker is decoding, as the orchestrator relays their tokens, and the
stall a prefill on that worker causes them.

A prompt prefilled on an engine that is decoding shares its steps with the running
decodes (chunked prefill): each decode's next token waits for the steps the prompt takes.
The orchestrator relays every token of every stream, so it measures that wait instead of
guessing it::

    stream on w:  ─┬───┬───┬──────────── stalled ────────────┬───┬──
                   t0  t1  t2                                 t3  t4
    prefill on w:          [start ═══════════════════════ end]   (its first token)

A stream's stall in a prefill's window [start, end] is, over its inter-token gaps that
overlap the window (the gap still open at ``end`` included), the overlap beyond the usual
gap. The usual gap is the worker's quiet step: the median of its streams' recent gaps that
no prefill on the worker overlapped (dispatched and not yet at its first token, or ending
inside the gap). Under steady load a stream's own gaps are mostly stalled ones, so their
median would call a stall usual: measured on two cores, 3-9 streams behind 2-3k-token
prompts had their stalls measured as 0.0 s against seconds predicted. Until the worker has
``MIN_QUIET_GAPS`` quiet gaps, the usual gap is the median of the stream's gaps before the
window (a stream with too few uses the median of the other streams'; without any it is not
measured). A prefill's stall is the sum over the streams decoding on its worker. Its
window starts when it was dispatched, or when the previous prefill on that worker ended,
whichever is later: an engine computes the prompts queued on it in turn, so waiting
behind another prompt is that prompt's stall, not this one's.

Not seen: streams that other orchestrator replicas relay, and streams that ended inside the
window (their stall ended with them).

The planner reads each worker's streams (``on``): how far each is, and its TPOT target.

Single writer: the event loop, through ``CompletionService``: ``started`` when a stream's
tokens begin to come from a worker, ``token`` for each chunk it relays, ``ended`` when the
stream leaves the worker, ``prefill_dispatched`` when a prompt is sent to be prefilled,
``prefilled`` at its first token and ``prefill_dropped`` when it failed before one.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from orchestrator.planner.views import DecodeStream

# Arrival times kept per stream: enough gaps for a median before any window and to cover a
# window of many seconds at CPU step times; older gaps say little about the stream now.
ARRIVALS_KEPT = 64
# Gaps a stream needs before a window for a usual gap of its own: the median of one gap is
# that gap, and the first after a hand-off or a prompt is rarely a usual one.
MIN_USUAL_GAPS = 2
# A worker's quiet gaps kept: recent enough to follow its batch as it grows and shrinks.
QUIET_GAPS_KEPT = 64
# Quiet gaps a worker needs before they set the usual gap (one could be an odd step).
MIN_QUIET_GAPS = 3


@dataclass(frozen=True)
class Stall:
    """What one prefill cost the streams decoding on its worker: ``seconds`` summed over the
    ``streams`` measured."""

    seconds: float
    streams: int


@dataclass
class _Stream:
    tpot_target: float
    tokens_left: int
    arrivals: deque[float] = field(default_factory=lambda: deque(maxlen=ARRIVALS_KEPT))
    first_at: float | None = None
    tokens: int = 0  # relayed since ``first_at``, the first token excluded

    def usual_gap(self, before: float) -> float | None:
        """The median of its gaps that ended by ``before``; None with fewer than ``MIN_USUAL_GAPS``."""
        times = [at for at in self.arrivals if at <= before]
        gaps = [later - earlier for earlier, later in zip(times, times[1:])]
        return statistics.median(gaps) if len(gaps) >= MIN_USUAL_GAPS else None

    def excess(self, start: float, end: float, usual: float) -> float:
        """Seconds its gaps overlapping [start, end] lasted beyond ``usual``, each gap clipped to
        the window; the gap open at ``end`` counts up to ``end``."""
        times = [*self.arrivals, end] if self.arrivals and self.arrivals[-1] < end else list(self.arrivals)
        total = 0.0
        for earlier, later in zip(times, times[1:]):
            overlap = min(later, end) - max(earlier, start)
            total += max(0.0, overlap - usual)
        return total


class DecodeStreams:
    """Per worker, the streams decoding there. Single writer: the event loop."""

    def __init__(self):
        self._streams: dict[str, dict[str, _Stream]] = {}
        # When each worker's latest prefill ended: one time per worker id (a restarted worker keeps its id).
        self._last_prefill_end: dict[str, float] = {}
        # The prompts dispatched to each worker that have not had their first token yet.
        self._prefilling: dict[str, set[str]] = {}
        self._quiet_gaps: dict[str, deque[float]] = {}

    def started(self, worker_id: str, stream_id: str, tpot_target: float, tokens_left: int) -> None:
        """``stream_id``'s next tokens come from ``worker_id``; it wants ``tokens_left`` more at
        most, at ``tpot_target`` seconds a token (0: no target)."""
        self._streams.setdefault(worker_id, {})[stream_id] = _Stream(tpot_target, tokens_left)

    def token(self, worker_id: str, stream_id: str, count: int, now: float) -> None:
        """A chunk of ``count`` tokens of ``stream_id`` arrived from ``worker_id`` at ``now``."""
        stream = self._streams.get(worker_id, {}).get(stream_id)
        if stream is None or count <= 0:
            return
        stream.tokens_left = max(0, stream.tokens_left - count)
        if stream.first_at is None:
            stream.first_at, count = now, count - 1  # gaps are counted from its first token here
        elif stream.arrivals and self._quiet_since(worker_id, stream.arrivals[-1]):
            self._quiet_gaps.setdefault(worker_id, deque(maxlen=QUIET_GAPS_KEPT)).append(now - stream.arrivals[-1])
        stream.tokens += count
        stream.arrivals.append(now)

    def _quiet_since(self, worker_id: str, since: float) -> bool:
        """No prefill ran on ``worker_id`` from ``since`` until now."""
        return not self._prefilling.get(worker_id) and self._last_prefill_end.get(worker_id, since) <= since

    def quiet_gap(self, worker_id: str) -> float | None:
        """The median of ``worker_id``'s recent quiet gaps; None with fewer than ``MIN_QUIET_GAPS``."""
        gaps = self._quiet_gaps.get(worker_id, ())
        return statistics.median(gaps) if len(gaps) >= MIN_QUIET_GAPS else None

    def on(self, worker_id: str) -> tuple[DecodeStream, ...]:
        """The streams decoding on ``worker_id`` that have had a token from it, as the planner sees them."""
        return tuple(DecodeStream(stream.tpot_target, stream.tokens, stream.arrivals[-1] - stream.first_at,
                                  stream.tokens_left)
                     for stream in self._streams.get(worker_id, {}).values() if stream.first_at is not None)

    def ended(self, worker_id: str, stream_id: str) -> None:
        streams = self._streams.get(worker_id)
        if streams is not None:
            streams.pop(stream_id, None)
            if not streams:
                del self._streams[worker_id]

    def prefill_dispatched(self, worker_id: str, request_id: str) -> None:
        """``request_id``'s prompt was sent to ``worker_id`` to be prefilled."""
        self._prefilling.setdefault(worker_id, set()).add(request_id)

    def prefill_dropped(self, worker_id: str, request_id: str, now: float) -> None:
        """``request_id`` left ``worker_id`` before its first token (failed, cancelled): the
        engine may have computed part of it until ``now``. Nothing if it had its first token."""
        if self._end_prefill(worker_id, request_id):
            self._last_prefill_end[worker_id] = max(now, self._last_prefill_end.get(worker_id, now))

    def _end_prefill(self, worker_id: str, request_id: str) -> bool:
        prefilling = self._prefilling.get(worker_id)
        if prefilling is None or request_id not in prefilling:
            return False
        prefilling.discard(request_id)
        if not prefilling:
            del self._prefilling[worker_id]
        return True

    def prefilled(self, worker_id: str, request_id: str, dispatched_at: float, now: float) -> Stall | None:
        """``request_id``'s prefill, dispatched to ``worker_id`` at ``dispatched_at``, had its
        first token at ``now``: the stall it caused the streams decoding there (None when none
        was measured)."""
        self._end_prefill(worker_id, request_id)
        start = max(dispatched_at, self._last_prefill_end.get(worker_id, dispatched_at))
        self._last_prefill_end[worker_id] = now
        if start >= now:
            return None
        streams = [stream for stream in self._streams.get(worker_id, {}).values() if stream.arrivals]
        quiet = self.quiet_gap(worker_id)
        if quiet is not None:
            return Stall(sum(stream.excess(start, now, quiet) for stream in streams), len(streams)) if streams else None
        own = [stream.usual_gap(start) for stream in streams]
        known = [gap for gap in own if gap is not None]
        fallback = statistics.median(known) if known else None
        measured = [(stream, fallback if gap is None else gap) for stream, gap in zip(streams, own)
                    if gap is not None or fallback is not None]
        if not measured:
            return None
        return Stall(sum(stream.excess(start, now, usual) for stream, usual in measured), len(measured))
