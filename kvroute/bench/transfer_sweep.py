"""What ``kvroute bench transfer`` measures and how its numbers combine; pure functions.

A sweep moves each prompt length's KV bytes (one frame per layer, as the connector
does) over every backend of every link, and compares that with recomputing the
prompt on the engine. The rows here are what ``results.json`` holds; the crossover of
a series is the prompt length where transfer and recompute take equally long.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SMALLEST_PROMPT_TOKENS = 128  # one vLLM CPU block


@dataclass(frozen=True)
class KVBytes:
    """KV bytes per prompt token and the layers they are split over; ``source`` says
    whether an engine reported them or they were computed from the model's config."""

    bytes_per_token: int
    num_layers: int
    dtype: str
    source: str

    def __post_init__(self) -> None:
        if self.bytes_per_token % self.num_layers:
            raise ValueError(f"{self.bytes_per_token} bytes per token do not split over {self.num_layers} layers")

    def frame_bytes(self, prompt_tokens: int) -> int:
        """One layer's share of a prompt's KV: what one frame of the transfer carries."""
        return prompt_tokens * self.bytes_per_token // self.num_layers

    def prompt_bytes(self, prompt_tokens: int) -> int:
        return prompt_tokens * self.bytes_per_token


def kv_bytes_from_config(config: Mapping, dtype_bytes: int, dtype: str) -> KVBytes:
    """K and V of every layer for one token, from a Hugging Face ``config.json``."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    layers = config["num_hidden_layers"]
    return KVBytes(2 * kv_heads * head_dim * dtype_bytes * layers, layers, dtype, source="model config")


def prompt_lengths(max_prompt_tokens: int, smallest: int = SMALLEST_PROMPT_TOKENS) -> list[int]:
    """Powers of two from ``smallest`` up to ``max_prompt_tokens``."""
    if max_prompt_tokens < smallest:
        raise ValueError(f"--max-prompt-tokens must be at least {smallest}")
    return [smallest << shift for shift in range(int(math.log2(max_prompt_tokens // smallest)) + 1)]


def lengths_within(lengths: Iterable[int], kv: KVBytes, bits_per_second: int, max_seconds: float) -> list[int]:
    """The lengths whose KV crosses a link of that rate in at most ``max_seconds`` (at
    least the shortest one): a slow link's long transfers would take minutes to repeat."""
    lengths = sorted(lengths)
    fitting = [n for n in lengths if kv.prompt_bytes(n) * 8 / bits_per_second <= max_seconds]
    return fitting or lengths[:1]


def comparison_row(link: str, backend: str, tokens: int, nbytes: int, transfer: float,
                   recompute: float | None, measured: bool = True, baseline: str | None = None,
                   raw_seconds: float | None = None, ratio: float | None = None) -> dict:
    """One (link, backend, prompt length) row of ``results.json``. ``measured`` is False for
    a transfer time predicted from the link's estimate at a length the link did not run."""
    return {"link": link, "prompt_tokens": tokens, "backend": backend, "bytes": nbytes,
            "transfer_seconds": transfer, "recompute_seconds": recompute, "measured": measured,
            "raw_baseline": baseline, "raw_baseline_seconds": raw_seconds, "ratio_vs_raw": ratio,
            "faster": None if recompute is None else ("transfer" if transfer < recompute else "recompute")}


def result_rows(link: str, kv: KVBytes, pair_rows: Iterable[Mapping],
                recompute_seconds: Mapping[int, float]) -> list[dict]:
    """One row per (prompt length, backend) of a link: transfer against recompute and
    against the raw baseline. ``pair_rows`` are ``transfer_pair`` rows of this link."""
    rows = []
    for pair in pair_rows:
        tokens = pair["bytes"] // kv.bytes_per_token
        row = comparison_row(link, pair["backend"], tokens, pair["bytes"], pair["backend_seconds"],
                             recompute_seconds.get(tokens), baseline=pair["baseline"],
                             raw_seconds=pair["raw_seconds"], ratio=pair["ratio"])
        if "checksum_seconds" in pair:  # the same transfer with per-frame checksums
            row |= {"checksum_seconds": pair["checksum_seconds"], "checksum_ratio": pair["checksum_ratio"]}
        rows.append(row)
    return sort_rows(rows)


def sort_rows(rows: Iterable[dict]) -> list[dict]:
    return sorted(rows, key=lambda row: (row["link"], row["backend"], row["prompt_tokens"]))


def crossover(points: list[tuple[int, float, float, bool]]) -> dict:
    """Where transfer and recompute take equally long, from (tokens, transfer s, recompute s,
    measured) sorted by tokens: interpolated on a log2 token axis between the two lengths
    around each change of sign; ``predicted`` when either of them was not measured. Empty
    when one side wins at every length."""
    crossings = []
    for (tokens_a, transfer_a, recompute_a, measured_a), (tokens_b, transfer_b, recompute_b, measured_b) \
            in zip(points, points[1:]):
        gap_a, gap_b = transfer_a - recompute_a, transfer_b - recompute_b
        if gap_a == 0 or gap_a * gap_b < 0:
            share = gap_a / (gap_a - gap_b)
            log_tokens = math.log2(tokens_a) + share * (math.log2(tokens_b) - math.log2(tokens_a))
            crossings.append({"prompt_tokens": round(2 ** log_tokens), "between": [tokens_a, tokens_b],
                              "transfer_faster_above": gap_b < 0, "predicted": not (measured_a and measured_b)})
    measured = [point for point in points if point[3]]
    return {"crossings": crossings,
            "transfer_faster_at": [tokens for tokens, transfer, recompute, _ in measured if transfer < recompute],
            "recompute_faster_at": [tokens for tokens, transfer, recompute, _ in measured if transfer >= recompute]}


def crossovers(rows: Iterable[Mapping]) -> list[dict]:
    """``crossover`` of every (link, backend) series that has recompute times."""
    series: dict[tuple[str, str], list[tuple[int, float, float, bool]]] = {}
    for row in rows:
        if row["recompute_seconds"] is not None:
            series.setdefault((row["link"], row["backend"]), []).append(
                (row["prompt_tokens"], row["transfer_seconds"], row["recompute_seconds"], row["measured"]))
    return [{"link": link, "backend": backend, **crossover(sorted(points))}
            for (link, backend), points in sorted(series.items())]
