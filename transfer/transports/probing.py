"""Choosing a link's backend by measurement, when "auto" has more than one candidate.

Both ends compute the same candidates from the two hellos (``selection.measured_candidates``:
the automatic choice, then nixl where both ends run it). Each is set up and timed with a
short probe, and the receiver keeps the fastest and tells the sender::

    sender                                         receiver
      for each candidate, in order:
        host it ── LinkSetup(candidate, address) ──▶ join it
        probe transfers: a warm-up, then timed ────▶ receive them, timing the timed ones
      ◀── LinkChoice(LinkMeasurement) ─────────────  the fastest (selection.fastest_candidate)
      check it is one it probed, keep it,           keep it, close the others
      close the others

The receiver times because a pull waits there, and it alone decides, so the two ends
cannot disagree: the sender keeps what the LinkChoice names, and refuses the link if that
is not a candidate it probed. A candidate that cannot be hosted, joined or probed within
``PROBE_SECONDS`` is measured as None and never chosen; when no candidate could be probed
both ends refuse the link, as a failed set-up of the automatic choice alone would.

The warm-up is not timed because a link's first transfer pays its connection set-up
(NIXL connects UCX on the first READ; ZeroMQ on the first message), which later pulls do
not. Probe frames are shaped like a pull of the link's own layout (one frame per layer,
whole blocks, about ``PROBE_BYTES`` in all), so per-message costs weigh as in a real pull.

Cost, bounded: per candidate, its set-up and ``1 + TIMED_PROBES`` transfers of about
``PROBE_BYTES``, within ``PROBE_SECONDS``; it is paid once per producer–consumer pair, by
the first pull between them (measured in docs/transfer.md, "Choosing nixl by measurement").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from foundation.wire import KVLayoutSpec, LinkChoice, LinkMeasurement, LinkSetup
from transfer.transports.base import Receiver, Sender
from transfer.transports.control import ControlChannel
from transfer.transports.errors import LinkRefused
from transfer.transports.handshake import receive, send
from transfer.transports.selection import fastest_candidate

logger = logging.getLogger("kvroute.transfer.links")

PROBE_BYTES = 4 << 20
TIMED_PROBES = 2
PROBE_SECONDS = 2.0  # one candidate's set-up and probes; past it, the candidate is not chosen
_PROBE_IDS = range(1, 2 + TIMED_PROBES)  # transfer ids: the warm-up, then the timed probes

# The caller's way to open one candidate's end by its deadline: the sender hosts it and
# announces it (LinkSetup); the receiver joins what that LinkSetup announced.
OpenSender = Callable[[str, float], Sender]
JoinAnnounced = Callable[[str, LinkSetup, float], Receiver]


def probe_frames(layout: KVLayoutSpec, target_bytes: int = PROBE_BYTES) -> list[int]:
    """One probe transfer's frame sizes: a pull of the whole blocks nearest ``target_bytes``
    (at least one), a frame per layer."""
    num_blocks = max(1, round(target_bytes / layout.bytes_per_block))
    return [num_blocks * layout.bytes_per_block // layout.num_layers] * layout.num_layers


def agreed_end(choice: LinkChoice, probed: dict[str, Sender]) -> Sender:
    """The sender's end the receiver's ``choice`` names; LinkRefused when it names none, or
    one this end did not probe (the two ends then disagree on the candidates)."""
    if choice.error or choice.measurement is None:
        raise LinkRefused(f"no candidate backend could be probed: {choice.error or 'no measurement'}")
    end = probed.get(choice.measurement.chosen)
    if end is None:
        raise LinkRefused(f"the receiver chose {choice.measurement.chosen}, which this end did not probe "
                          f"(it probed {sorted(probed)})")
    return end


def measure_as_sender(control: ControlChannel, candidates: Sequence[str], frame_bytes: list[int],
                      open_end: OpenSender, deadline: float) -> Sender:
    """Host and probe each candidate, then keep the one the receiver chose."""
    probed: dict[str, Sender] = {}
    try:
        for name in candidates:
            end = _probe_sending(name, frame_bytes, open_end, deadline)
            if end is not None:
                probed[name] = end
        choice = receive(control, LinkChoice, deadline)
        chosen = agreed_end(choice, probed)
    except BaseException:
        _close_all(probed.values())
        raise
    _close_all(end for end in probed.values() if end is not chosen)
    chosen.measurement = choice.measurement
    logger.info("a peer chose %s for a link by measurement (%s)", chosen.backend, describe(choice.measurement))
    return chosen


def measure_as_receiver(control: ControlChannel, candidates: Sequence[str], frame_bytes: list[int],
                        join: JoinAnnounced, deadline: float) -> Receiver:
    """Join and time each candidate, keep the fastest, and tell the sender which."""
    started = time.perf_counter()
    probed: dict[str, Receiver] = {}
    seconds: list[float | None] = []
    try:
        for name in candidates:
            setup = receive(control, LinkSetup, deadline)
            end, elapsed = _probe_receiving(name, setup, frame_bytes, join, deadline)
            seconds.append(elapsed)
            if end is not None:
                probed[name] = end
        chosen = fastest_candidate(candidates, seconds)
        if chosen is None:
            send(control, LinkChoice(error=f"none of {list(candidates)} could be probed"))
            raise LinkRefused(f"none of the candidate backends {list(candidates)} could be probed")
        measurement = LinkMeasurement(chosen=chosen, candidates=list(candidates), seconds=seconds,
                                      probe_bytes=sum(frame_bytes),
                                      set_up_seconds=time.perf_counter() - started)
        send(control, LinkChoice(measurement=measurement))
    except BaseException:
        _close_all(probed.values())
        raise
    _close_all(end for name, end in probed.items() if name != chosen)
    end = probed[chosen]
    end.measurement = measurement
    logger.info("chose %s for a link by measurement (%s)", chosen, describe(measurement))
    return end


def describe(measurement: LinkMeasurement) -> str:
    """e.g. "probe of 4.0 MiB: zmq-ipc 0.0091 s, nixl 0.0032 s; set-up 0.412 s"."""
    timings = ", ".join(f"{name} {'failed' if elapsed is None else f'{elapsed:.4f} s'}"
                        for name, elapsed in zip(measurement.candidates, measurement.seconds))
    return (f"probe of {measurement.probe_bytes / (1 << 20):.1f} MiB: {timings}; "
            f"set-up {measurement.set_up_seconds:.3f} s")


def _probe_sending(name: str, frame_bytes: list[int], open_end: OpenSender, deadline: float) -> Sender | None:
    """The candidate's end after its probe transfers left, or None if it could not be probed."""
    probe_by = min(deadline, time.monotonic() + PROBE_SECONDS)
    end = None
    try:
        end = open_end(name, probe_by)
        for transfer_id in _PROBE_IDS:
            end.send(frame_bytes, _zeros, probe_by, transfer_id)
        return end
    except Exception as error:  # noqa: BLE001 - a candidate that fails is not chosen; the others still are
        logger.warning("could not probe a %s link as its sender, so it is not chosen: %s", name, error)
        if end is not None:
            end.close()
        return None


def _probe_receiving(name: str, setup: LinkSetup, frame_bytes: list[int], join: JoinAnnounced,
                     deadline: float) -> tuple[Receiver | None, float | None]:
    """The candidate's end and the seconds of one timed probe, or (None, None)."""
    probe_by = min(deadline, time.monotonic() + PROBE_SECONDS)
    end = None
    try:
        end = join(name, setup, probe_by)
        warm_up, *timed = _PROBE_IDS
        end.receive(frame_bytes, _discard, probe_by, warm_up)
        started = time.perf_counter()
        for transfer_id in timed:
            end.receive(frame_bytes, _discard, probe_by, transfer_id)
        return end, (time.perf_counter() - started) / len(timed)
    except Exception as error:  # noqa: BLE001 - as in _probe_sending
        logger.warning("could not probe a %s link as its receiver, so it is not chosen: %s", name, error)
        if end is not None:
            end.close()
        return None, None


def _zeros(index: int, out: torch.Tensor) -> None:
    """A probe frame: written like a gathered layer, but with nothing of any cache in it."""
    out.zero_()


def _discard(index: int, data: torch.Tensor) -> None:
    pass


def _close_all(ends) -> None:
    for end in list(ends):
        end.close()
