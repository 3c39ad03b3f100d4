"""The simulator's inputs measured on a real cluster: cost curves, cluster shape, core binding.

The source is what ``kvroute bench placement`` writes (``results.json``: settings,
machine, workload, ``workers`` labelled ``role@core``, per-request rows with client
timings, cached tokens, plan and workers) and, optionally, the decision records in the
cluster's log (``read_decisions(serve.log)``: each pull's bytes and seconds).

* **prefill** (``prefill_*``): the production least squares (``fit_prefill``) over the
  requests whose prefill ran alone: while its engine did nothing else and no engine
  bound to the same core was busy. TTFT as the client saw it is the prefill's time, so
  the fixed term also holds the HTTP and orchestrator overhead (~10-20 ms);
* **decode step** (``decode_*``): the gaps between streamed tokens 2..N, each one step of
  the decode engine, with the batch size the replay had then (requests decoding on that
  worker), again only while nothing else computed on its core and it prefilled nothing;
  a line through the median gap of each batch size (weighted by its count), since a
  token delayed by a recompute is an outlier a mean would follow;
* **link**: ``latency + bytes / bandwidth`` through the pulls' (bytes, seconds), when
  decision records are given; otherwise the defaults;
* **KV bytes per token**: the KV cache's bytes over its tokens (``workload``);
* **step jitter**: the spread of the lone prefills' times around the fitted curve (a
  robust sigma of the log ratio): what a step varies by beyond the curves.

``failed_pulls`` finds the requests whose pull the real cluster refused (the decode
workers' logs name them; the decode worker then prefilled them again), for replaying
those faults (``SimulationSettings.failed_pulls``).

"Busy" is read off the rows: a request occupies its prefilling engine from when it was
sent to its first token, and its decode engine from its first token to its last (a
LOCAL request occupies one engine throughout). Each policy's rows have their own clock.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from orchestrator.planner.calibration import fit_prefill, prefill_features
from orchestrator.planner.cost_model import PrefillCoefficients, prefill_seconds_with
from simulator.calibration import SimCalibration
from simulator.cpu import CpuSettings
from simulator.engine import EngineConfig
from simulator.simulate import SimulationSettings

VLLM_CPU_BLOCK_SIZE = 128  # vLLM's default block size on CPU, for replays that recorded neither decisions nor it
# The workers' per-request step caps (``worker.settings``) in replays that did not
# record them: decode workers capped prompts at 256 tokens, prefill workers did not.
CAPS_BEFORE_THEY_WERE_RECORDED = {"prefill": 0, "decode": 256}
MIN_PREFILLS, MIN_GAPS, MIN_PULLS = 8, 8, 2  # fewer points than these leave a field at its default
_LABEL = re.compile(r"^(prefill|decode)@(\d+(?:,\d+)*)")
_FAILED_PULL = re.compile(r"pull for request ([0-9a-f]+)-[0-9a-f]+ failed")


@dataclass(frozen=True)
class Busy:
    worker_id: str
    start: float
    end: float
    index: int
    kind: str  # "prefill" | "decode"


@dataclass(frozen=True)
class ReplayCluster:
    """The real cluster's shape, as the simulator takes it: its engines hold a sent
    prefill's blocks for a step (``EngineConfig.hold_sent_blocks``) and report their load
    once per step (``stats_at_step_end``), as vLLM with kvroute's connector does."""

    num_prefill: int
    num_decode: int
    engine: EngineConfig
    cpu: CpuSettings
    worker_ids: tuple[str, ...]  # the real ids in simulated fleet order (prefills, then decodes)
    long_prefill_tokens: Mapping[str, int] = field(default_factory=dict)  # role -> the workers' per-request step cap

    def settings(self, **changes) -> SimulationSettings:
        engines = {"prefill_engine": self.engine_of("prefill"), "decode_engine": self.engine_of("decode")}
        return replace(SimulationSettings(**engines, cpu=self.cpu, stats_at_step_end=True), **changes)

    def engine_of(self, role: str) -> EngineConfig:
        return replace(self.engine, long_prefill_tokens=self.long_prefill_tokens.get(role, 0))


# ---------------------------------------------------------------- reading


def read_decisions(serve_log: str | Path) -> list[dict]:
    """The decision records ``kvroute.decisions`` logged, in order."""
    marker = "kvroute.decisions: "
    return [json.loads(line.split(marker, 1)[1]) for line in Path(serve_log).read_text().splitlines()
            if marker in line]


def succeeded_rows(results: dict) -> dict[str, list[dict]]:
    """Rows that got a first token and no error, by policy."""
    rows: dict[str, list[dict]] = {}
    for row in results["requests"]:
        if row.get("error") is None and row.get("ttft_s") is not None and row.get("counted", True):
            rows.setdefault(row["policy"], []).append(row)
    return rows


def worker_cores(results: dict) -> dict[str, tuple[int, ...]]:
    """Real worker id → the cores its engine is bound to, from labels like ``prefill@0``."""
    cores = {}
    for worker_id, label in results.get("workers", {}).items():
        match = _LABEL.match(label)
        if match:
            cores[worker_id] = tuple(int(core) for core in match.group(2).split(","))
    return cores


def failed_pulls(results: dict, decisions: Sequence[dict], worker_logs: Iterable[str]) -> dict[str, frozenset[int]]:
    """Policy → indices of its requests whose pull failed, from the workers' log texts."""
    response_of = {d["request_id"]: d["response_id"] for d in decisions}
    row_of = {row["response_id"]: row for row in results["requests"] if row.get("response_id")}
    failed: dict[str, set[int]] = {}
    for text in worker_logs:
        for request_id in _FAILED_PULL.findall(text):
            row = row_of.get(response_of.get(request_id, ""))
            if row is not None:
                failed.setdefault(row["policy"], set()).add(row["index"])
    return {policy: frozenset(indices) for policy, indices in failed.items()}


# ---------------------------------------------------------------- the cluster


def cluster_from_replay(results: dict, decisions: Sequence[dict] = ()) -> ReplayCluster:
    """Pools, engine limits and core binding of the replayed cluster. Fleet order is
    worker-id order within a pool, as the baselines see the workers."""
    roles = {role: sorted(w for w in results["workers"] if w.startswith(role)) for role in ("prefill", "decode")}
    ordered = tuple(roles["prefill"] + roles["decode"])
    recorded = results["workload"].get("block_size", VLLM_CPU_BLOCK_SIZE)  # not recorded: vLLM's default then
    block_size = next((d["block_size"] for d in decisions if d.get("block_size")), recorded)
    num_blocks = int(results["workload"]["kv_cache_tokens_per_worker"] // block_size)  # vLLM rounds down
    # Replays from before decode workers evicted pulled prompts first did not record it.
    evict_pulled_first = results["workload"].get("evict_pulled_first", False)
    engine = EngineConfig(num_blocks=num_blocks, block_size=block_size, hold_sent_blocks=True,
                          evict_pulled_first=evict_pulled_first)
    cores = worker_cores(results)
    cpus = results.get("machine", {}).get("cpus") or 0
    if cpus and all(w in cores for w in ordered):
        cpu = CpuSettings(cores=cpus, core_sets=tuple(cores[w] for w in ordered))
    else:
        cpu = CpuSettings(cores=cpus)  # the launcher's rule: engine i on core i % cpus
    caps = results["workload"].get("long_prefill_tokens", CAPS_BEFORE_THEY_WERE_RECORDED)
    return ReplayCluster(len(roles["prefill"]), len(roles["decode"]), engine, cpu, ordered, dict(caps))


# ---------------------------------------------------------------- who was busy when


def busy_intervals(rows: Iterable[dict]) -> list[Busy]:
    intervals = []
    for row in rows:
        sent = row["sent_s"]
        first, last = sent + row["ttft_s"], sent + row["e2e_s"]
        intervals.append(Busy(row["prefilling_worker"], sent, first, row["index"], "prefill"))
        intervals.append(Busy(row["decode_worker"], first, last, row["index"], "decode"))
    return intervals


def sharing(worker_id: str, cores: dict[str, tuple[int, ...]]) -> set[str]:
    """The workers whose work slows ``worker_id``: itself and those bound to one of its cores."""
    mine = set(cores.get(worker_id, ()))
    return {worker_id} | {other for other, theirs in cores.items() if mine & set(theirs)}


def _overlaps(busy: Busy, start: float, end: float) -> bool:
    return busy.start < end and busy.end > start


def alone(intervals: list[Busy], workers: set[str], start: float, end: float, index: int,
          kinds: tuple[str, ...] = ("prefill", "decode")) -> bool:
    """Whether no other request kept any of ``workers`` busy within [start, end]."""
    return not any(b.index != index and b.worker_id in workers and b.kind in kinds and _overlaps(b, start, end)
                   for b in intervals)


# ---------------------------------------------------------------- samples


def isolated_prefills(rows: list[dict], cores: dict[str, tuple[int, ...]]) -> list[tuple[int, int, float]]:
    """(new tokens, cached tokens, seconds) of the prefills that ran alone on their core(s)."""
    intervals = busy_intervals(rows)
    samples = []
    for row in rows:
        sent, worker = row["sent_s"], row["prefilling_worker"]
        if alone(intervals, sharing(worker, cores), sent, sent + row["ttft_s"], row["index"]):
            cached = row["cached_tokens"] or 0
            samples.append((row["prompt_tokens"] - cached, cached, row["ttft_s"]))
    return samples


def decode_gaps(rows: list[dict], cores: dict[str, tuple[int, ...]]) -> list[tuple[int, float]]:
    """(batch size, seconds) of the decode steps that ran with nothing else on their core(s)."""
    intervals = busy_intervals(rows)
    samples = []
    for row in rows:
        worker, times = row["decode_worker"], [row["sent_s"] + t for t in row["chunk_times_s"]]
        others = sharing(worker, cores) - {worker}
        first_step = 0 if row["plan_kind"] == "local" else 1  # a DISAGG request's first gap is its hand-off
        for start, end in zip(times[first_step:], times[first_step + 1:]):
            if not (alone(intervals, others, start, end, -1)
                    and alone(intervals, {worker}, start, end, -1, kinds=("prefill",))):
                continue
            middle = (start + end) / 2
            batch = sum(1 for b in intervals if b.worker_id == worker and b.kind == "decode"
                        and b.start <= middle < b.end)
            samples.append((max(batch, 1), end - start))
    return samples


def pull_samples(decisions: Iterable[dict]) -> list[tuple[int, float]]:
    """(bytes, seconds) of every pull a decision record timed."""
    samples = []
    for record in decisions:
        actual = record.get("actual") or {}
        if (actual.get("transfer_bytes") or 0) > 0 and (actual.get("transfer_seconds") or 0) > 0:
            samples.append((actual["transfer_bytes"], actual["transfer_seconds"]))
    return samples


# ---------------------------------------------------------------- fits


def nonnegative_line(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> tuple[float, float]:
    """(intercept, slope) of weighted least squares, each clamped at 0 by refitting without it."""
    weights = np.ones_like(x) if weights is None else weights
    root = np.sqrt(weights)
    intercept, slope = np.linalg.lstsq(np.column_stack((root, root * x)), root * y, rcond=None)[0]
    if slope < 0:
        return float(np.average(y, weights=weights)), 0.0
    if intercept < 0:
        return 0.0, float(np.sum(weights * x * y) / np.sum(weights * x * x))
    return float(intercept), float(slope)


def log_spread(points: np.ndarray, coefficients: PrefillCoefficients) -> float:
    """The spread of log(measured / fitted) over rows of (new, cached, seconds): the
    median absolute deviation scaled to a normal's sigma, so a few starved outliers do
    not widen it."""
    fitted = np.array([prefill_seconds_with(coefficients, int(new), int(cached)) for new, cached, _ in points])
    residuals = np.log(points[:, 2] / fitted)
    return float(1.4826 * np.median(np.abs(residuals - np.median(residuals))))


def fit_decode_step(gaps: list[tuple[int, float]]) -> tuple[float, float] | None:
    """(fixed seconds, seconds per sequence) of a decode step, through the per-batch medians."""
    by_batch: dict[int, list[float]] = {}
    for batch, seconds in gaps:
        by_batch.setdefault(batch, []).append(seconds)
    if len(gaps) < MIN_GAPS or len(by_batch) < 2:
        return None
    batches = np.array(sorted(by_batch), dtype=float)
    medians = np.array([np.median(by_batch[int(b)]) for b in batches])
    counts = np.array([len(by_batch[int(b)]) for b in batches], dtype=float)
    return nonnegative_line(batches, medians, counts)


def fit_link(pulls: list[tuple[int, float]]) -> tuple[float, float] | None:
    """(latency seconds, bytes per second) of the pulls; None when they cannot say."""
    if len(pulls) < MIN_PULLS:
        return None
    sizes, seconds = (np.array(column, dtype=float) for column in zip(*pulls))
    latency, seconds_per_byte = nonnegative_line(sizes, seconds)
    if seconds_per_byte <= 0:
        return None
    return latency, 1.0 / seconds_per_byte


def calibration_from_replay(results: dict, decisions: Sequence[dict] = ()) -> SimCalibration:
    """``SimCalibration`` fitted to a real replay (see the module docstring); a field whose
    samples are too few keeps its default."""
    cores = worker_cores(results)
    prefills, gaps = [], []
    for rows in succeeded_rows(results).values():
        prefills += isolated_prefills(rows, cores)
        gaps += decode_gaps(rows, cores)
    fields: dict = {}
    workload = results.get("workload", {})
    gib = results.get("settings", {}).get("kv_cache_gib_used")
    if gib and workload.get("kv_cache_tokens_per_worker"):
        fields["bytes_per_token"] = round(gib * 2**30 / workload["kv_cache_tokens_per_worker"])
    if len(prefills) >= MIN_PREFILLS:
        points = np.array(prefills, dtype=float)
        coefficients = fit_prefill(prefill_features(points[:, :2]), points[:, 2])
        if coefficients is not None:
            fields.update(prefill_fixed_seconds=coefficients.fixed_seconds,
                          prefill_per_token_seconds=coefficients.per_token_seconds,
                          prefill_attention_seconds=coefficients.attention_seconds,
                          step_jitter=log_spread(points, coefficients))
    step = fit_decode_step(gaps)
    if step is not None:
        fixed, per_sequence = step
        fields.update(decode_step_fixed_seconds=fixed, decode_per_sequence_seconds=per_sequence)
    link = fit_link(pull_samples(decisions))
    if link is not None:
        fields.update(link_latency_seconds=link[0], link_bandwidth_bytes_per_second=link[1])
    return SimCalibration(**fields)
