"""Online calibration of the cost model from what actually happened. Deterministic.

Single writer: whoever records request outcomes (the orchestrator's completion path)
calls ``observe``; planners only ever see the frozen ``CostModel`` that
``calibrated_model()`` builds from the current state.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import astuple, dataclass, replace

import numpy as np

from orchestrator.planner.cost_model import (
    DEFAULT_LINK,
    DEFAULT_PREFILL,
    DEFAULT_STALL_PER_PREFILL_SECOND,
    CostModel,
    LinkEstimate,
    PrefillCoefficients,
    prefill_seconds_with,
    transfer_seconds,
)

DEFAULT_WINDOW = 256  # recent prefills per class: enough to average noise, short enough to follow drift
DEFAULT_MIN_POINTS = 8  # three coefficients; a margin over three so one outlier cannot set them
DEFAULT_LINK_SMOOTHING = 0.2  # weight of the newest transfer; ~5 transfers of memory
# A worker's speed is the median of its recent prefills' measured over estimated times:
# few points make a median, and recent ones follow a neighbour that got busy or idle.
WORKER_SPEED_WINDOW = 32
WORKER_SPEED_MIN_POINTS = 4
# How long a measurement of one worker or one link is believed without a newer one. A
# worker or link measured slow is no longer chosen, so nothing would ever correct its
# estimate: in a real replay two transfers that overlapped on one link priced it at
# 7 MB/s (500 MB/s was usual), its prefill worker got 1 request of the next 120 and its
# cache stayed empty. Past this age the measurement is forgotten, the worker or link is
# priced like its peers, and the next request that suits it measures it again; one that
# really is slow costs one request per memory.
MEASUREMENT_MEMORY_SECONDS = 60.0
# Below this spread of transfer sizes (relative) the sizes cannot separate latency from bandwidth.
MIN_RELATIVE_SIZE_SPREAD = 0.05
# Bounds of one measured stall per second of prefill: one odd measurement (a client that
# stopped reading, a worker swapped out for a moment) can neither make prefilling beside
# decodes free nor forbid it. Chunked prefill puts the true ratio near 1; engines sharing
# cores, or a prefill estimated short, put it above.
STALL_RATIO_BOUNDS = (0.1, 4.0)
DEFAULT_STALL_SMOOTHING = 0.2  # weight of the newest measured stall: ~5 prefills of memory, as for links


def remembered(observed_at: float | None, now: float | None) -> bool:
    """Whether a measurement taken at ``observed_at`` still counts at ``now``; one without
    either time always does."""
    return now is None or observed_at is None or observed_at >= now - MEASUREMENT_MEMORY_SECONDS


def next_expiry(stamps: Iterable[float | None], now: float) -> float:
    """When the first of the measurements still remembered at ``now`` is forgotten."""
    return min((at + MEASUREMENT_MEMORY_SECONDS for at in stamps
                if at is not None and at + MEASUREMENT_MEMORY_SECONDS > now), default=math.inf)


def prefill_features(points: np.ndarray) -> np.ndarray:
    """The regressors of ``PrefillCoefficients``, in field order, for rows of
    (new tokens, cached tokens): 1, new, new * (new / 2 + cached)."""
    new, cached = points[:, 0], points[:, 1]
    return np.column_stack((np.ones(len(points)), new, new * (new / 2 + cached)))


def fit_prefill(rows: np.ndarray, seconds: np.ndarray) -> PrefillCoefficients | None:
    """Non-negative least squares by elimination: drop the most negative coefficient and
    refit until none is negative. None when the rows cannot determine the fit."""
    scale = np.abs(rows).max(axis=0)
    scale[scale == 0] = 1.0  # keeps an all-zero column (no attention yet) from dividing by zero
    active = [0, 1, 2]
    while active:
        solution, _, rank, _ = np.linalg.lstsq(rows[:, active] / scale[active], seconds, rcond=None)
        if rank < len(active):
            return None
        if solution.min() >= 0:
            coefficients = np.zeros(3)
            coefficients[active] = solution / scale[active]
            return PrefillCoefficients(*map(float, coefficients))
        del active[int(np.argmin(solution))]
    return PrefillCoefficients(0.0, 0.0, 0.0)


class PrefillCalibrator:
    """Least-squares fit of prefill time per worker class over a window of recent prefills."""

    def __init__(self, defaults: PrefillCoefficients = DEFAULT_PREFILL,
                 window: int = DEFAULT_WINDOW, min_points: int = DEFAULT_MIN_POINTS):
        if min_points < 3 or window < min_points:
            raise ValueError("need window >= min_points >= 3 to fit three coefficients")
        self.defaults = defaults
        self.window = window
        self.min_points = min_points
        self._observations: dict[str, deque[tuple[int, int, float]]] = {}
        self._by_worker: dict[str, deque[tuple[str, int, int, float, float | None]]] = {}

    def observe(self, worker_class: str, new_tokens: int, cached_tokens: int, seconds: float,
                worker_id: str = "", now: float | None = None) -> None:
        """One prefill's time; with ``worker_id`` it also counts towards that worker's speed,
        until ``MEASUREMENT_MEMORY_SECONDS`` after ``now`` (for good without ``now``)."""
        if new_tokens <= 0 or seconds <= 0:
            return  # nothing was computed, or the clock was wrong: neither says anything about cost
        history = self._observations.setdefault(worker_class, deque(maxlen=self.window))
        history.append((new_tokens, cached_tokens, seconds))
        if worker_id:
            own = self._by_worker.setdefault(worker_id, deque(maxlen=WORKER_SPEED_WINDOW))
            own.append((worker_class, new_tokens, cached_tokens, seconds, now))

    def forget_worker(self, worker_id: str) -> None:
        """Its own speed goes; its prefills stay in its class's fit."""
        self._by_worker.pop(worker_id, None)

    def speeds(self, coefficients: Callable[[str], PrefillCoefficients], now: float | None = None) -> dict[str, float]:
        """Each worker with enough recent prefills: the median of its measured over its
        class's estimated seconds (``coefficients(class)``, the model's own). Workers of one
        class share the fit, so the one on slower hardware or a busier core shows above 1
        and the others below. With ``now``, prefills older than the memory no longer count,
        and a worker without enough newer ones is priced like its class."""
        speeds = {}
        for worker_id, points in sorted(self._by_worker.items()):
            ratios = [seconds / predicted for worker_class, new, cached, seconds, at in points
                      if remembered(at, now)
                      and (predicted := prefill_seconds_with(coefficients(worker_class), new, cached)) > 0]
            if len(ratios) >= WORKER_SPEED_MIN_POINTS:
                speeds[worker_id] = float(np.median(ratios))
        return speeds

    def next_expiry(self, now: float) -> float:
        """When the first worker-speed point remembered at ``now`` is forgotten."""
        return next_expiry((point[-1] for points in self._by_worker.values() for point in points), now)

    def coefficients(self, worker_class: str) -> PrefillCoefficients:
        """The fit for ``worker_class``; with too few points for one, the defaults scaled to
        what was observed; with no points, the defaults."""
        history = self._observations.get(worker_class, ())
        return self._least_squares(history) or self._scaled_defaults(history) or self.defaults

    def fitted(self) -> dict[str, PrefillCoefficients]:
        """Only the classes with a least-squares fit; the cost model's default covers the rest."""
        fits = {name: self._least_squares(self._observations[name]) for name in sorted(self._observations)}
        return {name: fit for name, fit in fits.items() if fit is not None}

    def pooled(self) -> PrefillCoefficients | None:
        """One fit over every class's recent prefills: the estimate for a class without
        enough points of its own. Workers of one deployment share model and hardware far
        more often than not, so a fit from the other pool beats start-up defaults that may
        be an order of magnitude off (measured: 0.6 s assumed where 7 s was true), which
        would make the unfitted pool look idle-fast and draw every request. Before there
        are enough points for a fit, the defaults scaled to the points seen; None before
        the first."""
        history = [point for points in self._observations.values() for point in points]
        return self._least_squares(history) or self._scaled_defaults(history)

    def _least_squares(self, history) -> PrefillCoefficients | None:
        if len(history) < self.min_points:
            return None
        points = np.array(history, dtype=np.float64)  # rows of (new, cached, seconds)
        return fit_prefill(prefill_features(points), points[:, 2])

    def _scaled_defaults(self, history) -> PrefillCoefficients | None:
        """The defaults' shape, times the median of observed over predicted seconds: one
        parameter, which a single prefill determines, where three need many of several
        sizes. It fixes the order of magnitude (the machine), not the shape (the model)."""
        ratios = [seconds / predicted for new, cached, seconds in history
                  if (predicted := prefill_seconds_with(self.defaults, new, cached)) > 0]
        if not ratios:
            return None
        scale = float(np.median(ratios))
        return PrefillCoefficients(*(scale * value for value in astuple(self.defaults)))


@dataclass
class _LinkMoments:
    """Exponentially weighted means and (co)variance of transfer size and duration."""

    mean_bytes: float
    mean_seconds: float
    var_bytes: float = 0.0
    cov_bytes_seconds: float = 0.0

    def update(self, num_bytes: float, seconds: float, weight: float) -> None:
        # West's incremental form of the exponentially weighted covariance.
        delta_bytes, delta_seconds = num_bytes - self.mean_bytes, seconds - self.mean_seconds
        self.mean_bytes += weight * delta_bytes
        self.mean_seconds += weight * delta_seconds
        self.var_bytes = (1 - weight) * (self.var_bytes + weight * delta_bytes ** 2)
        self.cov_bytes_seconds = (1 - weight) * (self.cov_bytes_seconds + weight * delta_bytes * delta_seconds)


def link_estimate(moments: _LinkMoments, prior: LinkEstimate) -> LinkEstimate:
    """seconds = latency + bytes / bandwidth, fit on the weighted moments.

    When recent transfers were all about the same size the slope is undetermined, so we
    keep the prior latency (capped at half the mean duration) and solve for bandwidth."""
    spread = MIN_RELATIVE_SIZE_SPREAD * moments.mean_bytes
    if moments.var_bytes > spread ** 2 and moments.cov_bytes_seconds > 0:
        seconds_per_byte = moments.cov_bytes_seconds / moments.var_bytes
        latency = moments.mean_seconds - seconds_per_byte * moments.mean_bytes
        if latency >= 0:
            return LinkEstimate(1 / seconds_per_byte, latency)
    if moments.mean_bytes <= 0 or moments.mean_seconds <= 0:
        return prior
    latency = min(prior.latency_seconds, moments.mean_seconds / 2)
    return LinkEstimate(moments.mean_bytes / (moments.mean_seconds - latency), latency)


class LinkCalibrator:
    """Bandwidth and latency per (source, destination), following recent transfers.

    A link not used for ``MEASUREMENT_MEMORY_SECONDS`` is forgotten: priced like the
    fleet's typical link (``typical``) and relearned from its next transfer.

    Moving averages follow drift but take many transfers to leave a link's old speed
    behind, and each transfer planned on the stale estimate is one that hurts (a link
    that became 100x slower still looked fast after five slow transfers). So when
    ``SURPRISES_TO_RESTART`` transfers in a row take more than ``SURPRISE_FACTOR`` times
    longer (or all shorter) than estimated, and by more than ``SURPRISE_MIN_SECONDS``, the
    link is taken to have changed and its averages restart from the latest transfer. One
    surprise alone (a hiccup) only moves the averages. Only transfers of at least
    ``SURPRISE_MIN_SHARE`` of the link's mean size can surprise: a small one's time is
    mostly fixed overhead, and restarting from it prices the next large transfer as if the
    overhead were bandwidth. Measured in a real replay: one 4.4 MB pull took 5 ms and the
    next 2.9 MB pull 379 ms, counted as two surprises in a row, and the restart priced a
    50 MB pull at 6.4 s (it took 0.24 s)."""

    SURPRISE_FACTOR = 3.0
    SURPRISE_MIN_SECONDS = 0.05  # differences smaller than this do not change a plan
    SURPRISE_MIN_SHARE = 0.5
    SURPRISES_TO_RESTART = 2

    def __init__(self, prior: LinkEstimate = DEFAULT_LINK, smoothing: float = DEFAULT_LINK_SMOOTHING):
        if not 0 < smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")
        self.prior = prior
        self.smoothing = smoothing
        self._moments: dict[tuple[str, str], _LinkMoments] = {}
        self._surprises: dict[tuple[str, str], int] = {}
        self._observed_at: dict[tuple[str, str], float | None] = {}

    def observe(self, source: str, destination: str, num_bytes: int, seconds: float,
                now: float | None = None) -> None:
        """One transfer's time; remembered until the memory after ``now`` (for good without it)."""
        if num_bytes <= 0 or seconds <= 0:
            return
        link = (source, destination)
        moments = self._moments.get(link)
        if moments is None or not remembered(self._observed_at.get(link), now) or \
                self._link_changed(link, moments, num_bytes, seconds):
            self._moments[link] = _LinkMoments(float(num_bytes), seconds)
            self._surprises[link] = 0
        else:
            moments.update(float(num_bytes), seconds, self.smoothing)
        self._observed_at[link] = now

    def forget_worker(self, worker_id: str) -> None:
        """Every link from or to ``worker_id``."""
        for link in [link for link in self._moments if worker_id in link]:
            del self._moments[link]
            self._surprises.pop(link, None)
            self._observed_at.pop(link, None)

    def next_expiry(self, now: float) -> float:
        """When the first link remembered at ``now`` is forgotten."""
        return next_expiry(self._observed_at.values(), now)

    def _link_changed(self, link: tuple[str, str], moments: _LinkMoments, num_bytes: int, seconds: float) -> bool:
        """Counts surprises in a row, slower ones up and faster ones down: a slow one after
        a fast one starts a new row."""
        surprise = self._surprise(moments, num_bytes, seconds)
        row = self._surprises.get(link, 0)
        row = row + surprise if surprise and row * surprise >= 0 else surprise
        changed = abs(row) >= self.SURPRISES_TO_RESTART
        self._surprises[link] = 0 if changed else row
        return changed

    def _surprise(self, moments: _LinkMoments, num_bytes: int, seconds: float) -> int:
        """+1 for a transfer surprisingly slower than estimated, -1 for one surprisingly faster, else 0."""
        predicted = transfer_seconds(num_bytes, link_estimate(moments, self.prior))
        if num_bytes < self.SURPRISE_MIN_SHARE * moments.mean_bytes or \
                abs(seconds - predicted) <= self.SURPRISE_MIN_SECONDS:
            return 0
        if seconds > predicted * self.SURPRISE_FACTOR:
            return 1
        return -1 if seconds < predicted / self.SURPRISE_FACTOR else 0

    def estimate(self, source: str, destination: str) -> LinkEstimate:
        moments = self._moments.get((source, destination))
        return self.prior if moments is None else link_estimate(moments, self.prior)

    def estimates(self, now: float | None = None) -> dict[tuple[str, str], LinkEstimate]:
        """Every link measured within the memory of ``now`` (every link without ``now``)."""
        return {link: link_estimate(moments, self.prior) for link, moments in sorted(self._moments.items())
                if remembered(self._observed_at.get(link), now)}

    def typical(self, now: float | None = None) -> LinkEstimate:
        """``typical_link`` of the links measured within the memory, else the prior."""
        return typical_link(self.estimates(now).values(), self.prior)


def typical_link(estimates: Iterable[LinkEstimate], fallback: LinkEstimate) -> LinkEstimate:
    """The median bandwidth and latency of ``estimates`` (``fallback`` without any): what a
    link without an estimate of its own is priced at. Links of one deployment run over the
    same kind of network far more often than not."""
    estimates = list(estimates)
    if not estimates:
        return fallback
    return LinkEstimate(float(np.median([e.bandwidth_bytes_per_second for e in estimates])),
                        float(np.median([e.latency_seconds for e in estimates])))


class StallCalibrator:
    """Seconds each running decode stalls per second of a prefill beside it
    (``CostModel.stall_per_prefill_second``), from the stalls the orchestrator measures
    (``orchestrator.decode_streams``): an exponentially weighted mean, starting from
    ``prior``, of each prefill's measured stall per stream over its estimated prefill
    seconds, every measurement clamped to ``STALL_RATIO_BOUNDS`` (so the mean stays within
    them). Forgotten ``MEASUREMENT_MEMORY_SECONDS`` after the last measurement, back to
    ``prior``: a ratio measured high keeps prefills away from decoding workers, so nothing
    would ever measure it again."""

    def __init__(self, prior: float = DEFAULT_STALL_PER_PREFILL_SECOND,
                 smoothing: float = DEFAULT_STALL_SMOOTHING):
        if not 0 < smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")
        self.prior = prior
        self.smoothing = smoothing
        self._ratio: float | None = None
        self._observed_at: float | None = None

    def observe(self, stall_seconds: float, streams: int, prefill_seconds: float, now: float | None = None) -> None:
        """One prefill, estimated at ``prefill_seconds``, stalled ``streams`` decodes for
        ``stall_seconds`` in all; remembered until the memory after ``now`` (for good without it)."""
        if streams <= 0 or prefill_seconds <= 0 or stall_seconds < 0:
            return  # nothing was stalled, or nothing was estimated: no ratio
        low, high = STALL_RATIO_BOUNDS
        measured = min(max(stall_seconds / streams / prefill_seconds, low), high)
        current = self.ratio(now)
        self._ratio = current + self.smoothing * (measured - current)
        self._observed_at = now

    def ratio(self, now: float | None = None) -> float:
        """The mean of the measurements remembered at ``now``; ``prior`` without any."""
        if self._ratio is None or not remembered(self._observed_at, now):
            return self.prior
        return self._ratio

    def next_expiry(self, now: float) -> float:
        """When the measurement remembered at ``now`` is forgotten."""
        return next_expiry((self._observed_at,) if self._ratio is not None else (), now)


def calibrated_model(base: CostModel, prefill: PrefillCalibrator, links: LinkCalibrator,
                     now: float | None = None, tiers: LinkCalibrator | None = None,
                     stalls: StallCalibrator | None = None) -> CostModel:
    """A new frozen model: ``base`` with every fitted class and observed link replaced, the
    pooled fit (when there is one) for classes without their own, each worker's speed
    against the coefficients of that model, and the typical link for links without an
    estimate; node-store tiers with loads observed (``tiers``, keyed (TIER_LOADS, tier))
    priced at their fit; the stall of running decodes per second of prefill as measured
    (``stalls``). With ``now``, measurements past the memory are left out."""
    remembered_links = links.estimates(now)
    tier_loads = {tier: estimate for (_, tier), estimate in (tiers.estimates(now) if tiers else {}).items()}
    model = replace(base, prefill=prefill.pooled() or base.prefill,
                    prefill_by_class={**base.prefill_by_class, **prefill.fitted()},
                    links={**base.links, **remembered_links},
                    default_link=typical_link(remembered_links.values(), base.default_link),
                    tier_loads={**base.tier_loads, **tier_loads},
                    stall_per_prefill_second=stalls.ratio(now) if stalls else base.stall_per_prefill_second)
    return replace(model, prefill_speed={**base.prefill_speed, **prefill.speeds(model.coefficients_for, now)})


TIER_LOADS = "node-store"  # the source of a tier load's "link" in the tier calibrator: (TIER_LOADS, tier)


class Calibration:
    """The calibrators behind one model; ``calibrated_model()`` snapshots them. Loads
    from a node store's tier are fitted like a link (latency + bytes / bandwidth), one per
    tier, from the loads requests report (the lookup's wait included).

    The snapshot is refit at most once per ``refit_interval`` of the caller's clock:
    planning runs on every request's path to its first token, and a least-squares refit
    per request would sit on that path. It is refit only after new observations, or
    with a clock, once a measurement it used ages past the memory.
    """

    def __init__(self, base: CostModel | None = None, refit_interval: float = 1.0):
        self.base = base or CostModel()
        self.prefill = PrefillCalibrator(defaults=self.base.prefill)
        self.links = LinkCalibrator(prior=self.base.default_link)
        self.tiers = LinkCalibrator(prior=self.base.tier_loads["host"])
        self.stalls = StallCalibrator(prior=self.base.stall_per_prefill_second)
        self.refit_interval = refit_interval
        self._model = self.base
        self._fitted_at: float | None = None
        self._expires_at = math.inf  # when a measurement in the snapshot is forgotten
        self._dirty = False

    def observe_prefill(self, worker_class: str, new_tokens: int, cached_tokens: int, seconds: float,
                        worker_id: str = "", now: float | None = None) -> None:
        self.prefill.observe(worker_class, new_tokens, cached_tokens, seconds, worker_id, now)
        self._dirty = True

    def observe_link(self, source: str, destination: str, num_bytes: int, seconds: float,
                     now: float | None = None) -> None:
        self.links.observe(source, destination, num_bytes, seconds, now)
        self._dirty = True

    def observe_tier_load(self, tier: str, num_bytes: int, seconds: float, now: float | None = None) -> None:
        self.tiers.observe(TIER_LOADS, tier, num_bytes, seconds, now)
        self._dirty = True

    def observe_stall(self, stall_seconds: float, streams: int, prefill_seconds: float,
                      now: float | None = None) -> None:
        self.stalls.observe(stall_seconds, streams, prefill_seconds, now)
        self._dirty = True

    def forget_worker(self, worker_id: str) -> None:
        """The worker left the fleet: its speed and its links are no longer measurements of anything."""
        self.prefill.forget_worker(worker_id)
        self.links.forget_worker(worker_id)
        self._dirty = True

    def calibrated_model(self, now: float | None = None) -> CostModel:
        due = now is None or self._fitted_at is None or now - self._fitted_at >= self.refit_interval
        expired = now is not None and now >= self._expires_at
        if (self._dirty or expired) and due:
            self._model = calibrated_model(self.base, self.prefill, self.links, now, self.tiers, self.stalls)
            self._fitted_at, self._dirty = now, False
            self._expires_at = math.inf if now is None else min(self.prefill.next_expiry(now),
                                                                self.links.next_expiry(now),
                                                                self.tiers.next_expiry(now),
                                                                self.stalls.next_expiry(now))
        return self._model
