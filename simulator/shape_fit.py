"""The simulator's step curves fitted to one kvroute topology's real long-output runs.

The source is ``kvroute bench peers`` run with ``--systems kvroute`` and one
``--kvroute-topology`` (``1u``, ``2u``, ``1p1d``, ...): per request, the client's timings,
every streamed token's arrival, the prompt and cached tokens, and the decision record's
plan and workers. Every rate of a run has a clock of its own: pass each run's rows as one
list. Unlike ``simulator.from_replay`` (prompt-heavy replays whose prefills often ran
alone), long outputs keep their engines decoding, so almost no prefill runs alone:

* **decode step** (``decode_*``): as ``from_replay``: the gaps between streamed tokens 2..N
  while the engine (and any engine bound to one of its cores) prefilled nothing, with the
  batch decoding there then; a line through each batch size's median gap;
* **prefill** (``prefill_*``): the prefills during which no other prompt was computed on
  their engine's cores, decodes or not. A prefill that joins ``k`` decodes waits, on
  average, half a decode step of ``k`` for the step under way, then runs in a step that
  also decodes ``k`` sequences: what the fitted decode step says those cost is taken off
  its TTFT, and what is left is the prompt's own cost. The workload's prompts come in two
  kinds (a shared 512-token prefix cached, and a 64-token question to compute; or the
  whole prompt to compute), too few to separate the curve's per-token and attention
  terms, so the start-up curve's token part keeps its shape: the prompt's cost is a line
  ``fixed + slope x token part``, drawn through the medians of the cheaper and the dearer
  prompts (split halfway between the cheapest and the dearest token part: the cached
  prompts and the uncached ones; a resistant line, as a prompt that stalled behind
  something the rows do not show moves a median little). Where the prompts are all alike
  (fewer than three on either side, or the dearer ones' token part under 1.5x the
  cheaper ones') the whole curve is scaled by the median ratio instead;
* **step jitter**: the spread of the prompts' costs around the fitted curve (a robust
  sigma of the logs of their ratios);
* **link** (``link_*``): as ``from_replay``, through the pulls' (bytes, seconds) from the
  decision records, when the shape moved KV at all.

Everything else (tiers, KV bytes per token) keeps the values given, and the engine limits
come from the caller (``kvroute.bench.simulation.fit_shapes``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from orchestrator.planner.cost_model import PrefillCoefficients, prefill_seconds_with
from simulator.calibration import SimCalibration
from simulator.from_replay import MIN_PREFILLS, alone, busy_intervals, decode_gaps, fit_decode_step, fit_link, sharing

MIN_GROUP = 3  # prompts each end of the prefill line needs
Cores = Mapping[str, tuple[int, ...]]  # real worker id → the cores its engine is bound to


@dataclass(frozen=True)
class PromptCost:
    """One prefill that had its engine's cores to itself and its decodes."""

    new_tokens: int
    cached_tokens: int
    decodes: int  # sequences decoding on its engine when it arrived
    ttft_s: float


@dataclass(frozen=True)
class ShapeFit:
    calibration: SimCalibration
    prefill: PrefillCoefficients | None  # the fitted prefill curve; None: too few prompts, the start's kept
    prompt_costs: int  # prefills the curve came from
    decode_gaps: int  # token gaps the decode step came from
    pulls: int = 0  # KV pulls the link came from


def lone_prefills(rows: list[dict], cores: Cores) -> list[PromptCost]:
    """The prefills no other prefill overlapped on their engine's cores (see the module docstring)."""
    intervals = busy_intervals(rows)
    costs = []
    for row in rows:
        sent, worker = row["sent_s"], row["prefilling_worker"]
        if not alone(intervals, sharing(worker, cores), sent, sent + row["ttft_s"], row["index"], kinds=("prefill",)):
            continue
        decodes = sum(1 for b in intervals if b.worker_id == worker and b.kind == "decode" and b.start <= sent < b.end)
        cached = row["cached_tokens"] or 0
        costs.append(PromptCost(row["prompt_tokens"] - cached, cached, decodes, row["ttft_s"]))
    return costs


def prompt_seconds(cost: PromptCost, calibration: SimCalibration) -> float:
    """The part of ``cost``'s TTFT that its prompt took: the TTFT less the decodes it shared
    its step with and, when there were any, half a step of them waited for."""
    if not cost.decodes:
        return cost.ttft_s
    step = calibration.decode_step_fixed_seconds + calibration.decode_per_sequence_seconds * cost.decodes
    return cost.ttft_s - calibration.decode_per_sequence_seconds * cost.decodes - step / 2


def fit_shape(runs: Iterable[list[dict]], cores: Cores, pulls: Sequence[tuple[int, float]] = (),
              start: SimCalibration | None = None) -> ShapeFit:
    """``start`` (default: the simulator's defaults) with its step curves fitted to ``runs``
    (each a run's succeeded rows) and its link to ``pulls`` ((bytes, seconds), as
    ``from_replay.pull_samples`` reads them); a curve with too few samples keeps ``start``'s."""
    calibration = start or SimCalibration()
    link = fit_link(list(pulls))
    if link is not None:
        calibration = replace(calibration, link_latency_seconds=link[0], link_bandwidth_bytes_per_second=link[1])
    runs = list(runs)
    gaps = [gap for rows in runs for gap in decode_gaps(rows, cores)]
    step = fit_decode_step(gaps)
    if step is not None:
        calibration = replace(calibration, decode_step_fixed_seconds=step[0], decode_per_sequence_seconds=step[1])
    costs = [cost for rows in runs for cost in lone_prefills(rows, cores)]
    curve = fit_prefill_curve(costs, calibration)
    if curve is not None:
        fitted, spread = curve
        calibration = replace(calibration, prefill_fixed_seconds=fitted.fixed_seconds,
                              prefill_per_token_seconds=fitted.per_token_seconds,
                              prefill_attention_seconds=fitted.attention_seconds, step_jitter=spread)
    return ShapeFit(calibration, curve[0] if curve else None, len(costs), len(gaps), len(pulls))


def fit_prefill_curve(costs: Sequence[PromptCost],
                      calibration: SimCalibration) -> tuple[PrefillCoefficients, float] | None:
    """(the prefill curve, the spread of the costs around it) (see the module docstring);
    None when fewer than ``MIN_PREFILLS`` prompts left a positive cost."""
    points = [(cost, seconds) for cost in costs
              if cost.new_tokens > 0 and (seconds := prompt_seconds(cost, calibration)) > 0]
    if len(points) < MIN_PREFILLS:
        return None
    fixed = calibration.prefill_fixed_seconds
    tokens_only = PrefillCoefficients(0.0, calibration.prefill_per_token_seconds, calibration.prefill_attention_seconds)
    x = np.array([prefill_seconds_with(tokens_only, cost.new_tokens, cost.cached_tokens) for cost, _ in points])
    y = np.array([seconds for _, seconds in points])
    cheap = x < (x.min() + x.max()) / 2
    if min(cheap.sum(), (~cheap).sum()) >= MIN_GROUP and np.median(x[~cheap]) >= 1.5 * np.median(x[cheap]):
        x_low, x_high = np.median(x[cheap]), np.median(x[~cheap])
        y_low, y_high = np.median(y[cheap]), np.median(y[~cheap])
        slope = max(0.0, (y_high - y_low) / (x_high - x_low))
        intercept = max(0.0, y_low - slope * x_low)
    else:  # prompts all alike: the whole curve scaled
        scale = float(np.median(y / (fixed + x)))
        intercept, slope = fixed * scale, scale
    curve = PrefillCoefficients(float(intercept), tokens_only.per_token_seconds * slope,
                                tokens_only.attention_seconds * slope)
    logs = np.log(y / np.array([prefill_seconds_with(curve, c.new_tokens, c.cached_tokens) for c, _ in points]))
    return curve, float(1.4826 * np.median(np.abs(logs - np.median(logs))))
