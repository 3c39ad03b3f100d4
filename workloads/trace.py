"""Mooncake traces: read the JSONL records and scale them onto real token sequences.

A record is one request of the trace (the format of the Mooncake project's FAST'25
release, e.g. ``shared/data/mooncake_synthetic_trace.jsonl``)::

    {"timestamp": 40, "input_length": 23769, "output_length": 3, "hash_ids": [151, 152, ...]}

``timestamp`` is milliseconds since the first request; ``hash_ids`` name the prompt's
512-token blocks (the last one partial, rounded up), and equal leading ids mean the
requests share that prefix: the ids are chained, so an id stands for its whole prefix.

Scaling (``TraceScaling``), applied in this order:

* **length**: every 512-token block becomes ``block_tokens`` tokens (default 64, a factor
  of 1/8), so the prompt keeps its block structure and its sharing, and

      prompt_tokens = (blocks - 1) * block_tokens + ceil(last_block_tokens * block_tokens / 512)

  where ``last_block_tokens = input_length - 512 * (blocks - 1)``: a partial last block
  stays partial in proportion, and never shrinks to nothing. Outputs are multiplied by
  ``output_scale`` (default 1: the trace's outputs, 149 tokens on average, already fit a
  small model's context, and a decode step does not get cheaper with the prompt), rounded
  up, at least one token.
* **context**: a request whose scaled prompt plus output exceeds ``max_context_tokens``
  (default 8,192, SmolLM2's context) is dropped and counted in ``ScaledTrace.dropped``;
  at the defaults, 47 of the synthetic trace's 3,993 records (prompts over ~64k tokens).
* **time**: arrival seconds = timestamp / 1000 x ``time_scale`` (2.0 spreads the trace
  over twice the time, i.e. half the request rate; 0.5 doubles the rate).

Sampling, for clusters too small for the whole trace: ``sample_families`` keeps every
record of a seeded fraction of the prefix families (records with the same first hash id),
so the thinner trace keeps the trace's span and each family's sharing.

Content: hash id ``h`` becomes a fixed pseudo-random block of ``block_tokens`` token ids
drawn from ``(seed, h)`` (``workloads.tokens``); a partial last block is the leading
part of its id's block. So two requests share exactly the leading tokens the trace says
they share, on every machine, and nothing else beyond chance. Token ids are generated
when asked for (``TraceRequest.prompt_token_ids``) and not stored: the synthetic trace
alone would be ~8 million ids.

``TraceRequest`` is not a ``workloads.WorkloadRequest``: those carry chat messages, and a
chat template around trace tokens would shift every block boundary and with it what is
shared. Both have ``index``, ``arrival_seconds`` and ``max_tokens``; a trace request's
prompt is token ids, which ``/v1/completions`` takes as they are.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from workloads.tokens import FIRST_ORDINARY_ID, SMOLLM2_VOCAB_SIZE, pseudo_token_ids

MOONCAKE_BLOCK_TOKENS = 512


class TraceRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One line of a Mooncake trace, as it is in the file."""

    timestamp: int  # ms since the first request
    input_length: int
    output_length: int
    hash_ids: list[int]


_record_decoder = msgspec.json.Decoder(TraceRecord)


class TraceFormatError(ValueError):
    pass


def parse_record(line: str | bytes, line_number: int = 0) -> TraceRecord:
    try:
        record = _record_decoder.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise TraceFormatError(f"line {line_number}: {error}") from error
    blocks = math.ceil(record.input_length / MOONCAKE_BLOCK_TOKENS)
    if record.input_length < 1 or record.output_length < 0 or len(record.hash_ids) != blocks:
        raise TraceFormatError(f"line {line_number}: {record.input_length} input tokens need {blocks} "
                               f"hash ids of {MOONCAKE_BLOCK_TOKENS} tokens, got {len(record.hash_ids)}")
    return record


def sample_families(records: Sequence[TraceRecord], fraction: float, seed: int = 0) -> list[TraceRecord]:
    """Every record of a ``fraction`` of the trace's prefix families, in trace order.

    A family is the records with one first hash id; hash ids are chained, so records of
    different families share nothing. Keeping whole families gives a thinner trace over
    the same time with each family's sharing intact, where the first N records would keep
    the trace's start, before most families come back. A family is kept when the hash of
    (``seed``, its first id) falls below ``fraction``: the same families on every run."""
    if not 0 < fraction <= 1:
        raise ValueError("fraction must be in (0, 1]")

    def kept(first_id: int) -> bool:
        digest = hashlib.blake2b(f"{seed}:{first_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") < fraction * 2**64

    return [record for record in records if kept(record.hash_ids[0])]


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """The records of a Mooncake JSONL file, in file order; blank lines are skipped."""
    records: list[TraceRecord] = []
    with open(path, "rb") as lines:
        for line_number, line in enumerate(lines, 1):
            if limit is not None and len(records) >= limit:
                break
            if line.strip():
                records.append(parse_record(line, line_number))
    return records


@dataclass(frozen=True)
class TraceScaling:
    """How a trace is fitted to a small cluster; see the module docstring. Defaults documented there."""

    block_tokens: int = 64
    output_scale: float = 1.0
    max_context_tokens: int = 8192
    time_scale: float = 1.0
    seed: int = 0  # of the token content
    vocab_size: int = SMOLLM2_VOCAB_SIZE
    first_token_id: int = FIRST_ORDINARY_ID

    def __post_init__(self):
        if not 1 <= self.block_tokens <= MOONCAKE_BLOCK_TOKENS:
            raise ValueError(f"block_tokens must be in [1, {MOONCAKE_BLOCK_TOKENS}]")
        if not self.output_scale > 0 or not self.time_scale > 0:
            raise ValueError("output_scale and time_scale must be positive")
        if self.max_context_tokens < 2:
            raise ValueError("max_context_tokens must be >= 2")

    def prompt_tokens(self, record: TraceRecord) -> int:
        full_blocks = len(record.hash_ids) - 1
        last = record.input_length - MOONCAKE_BLOCK_TOKENS * full_blocks
        return full_blocks * self.block_tokens + math.ceil(last * self.block_tokens / MOONCAKE_BLOCK_TOKENS)

    def output_tokens(self, record: TraceRecord) -> int:
        return max(1, math.ceil(record.output_length * self.output_scale))

    def arrival_seconds(self, record: TraceRecord) -> float:
        return record.timestamp / 1000 * self.time_scale


@dataclass(frozen=True)
class BlockContent:
    """What each hash id's tokens are: a fixed pseudo-random block per (seed, id)."""

    seed: int
    block_tokens: int
    vocab_size: int = SMOLLM2_VOCAB_SIZE
    first_token_id: int = FIRST_ORDINARY_ID

    def block(self, hash_id: int, length: int | None = None) -> list[int]:
        label = b"kvroute-trace\x00%d\x00%d" % (self.seed, hash_id)
        count = self.block_tokens if length is None else length
        return pseudo_token_ids(label, count, self.vocab_size, self.first_token_id)

    def token_ids(self, hash_ids: Sequence[int], length: int) -> list[int]:
        """``length`` tokens of the chain ``hash_ids``, the last block truncated to fit."""
        tokens: list[int] = []
        for hash_id in hash_ids:
            tokens += self.block(hash_id, min(self.block_tokens, length - len(tokens)))
        return tokens


@dataclass(frozen=True)
class TraceRequest:
    """One scaled request: send ``prompt_token_ids`` at ``arrival_seconds``, generate ``max_tokens``."""

    index: int  # the record's position in the trace, kept when other records were dropped
    arrival_seconds: float
    prompt_tokens: int
    max_tokens: int
    hash_ids: tuple[int, ...]
    content: BlockContent = field(repr=False)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.content.token_ids(self.hash_ids, self.prompt_tokens)


@dataclass(frozen=True)
class ScaledTrace:
    requests: list[TraceRequest]
    dropped: int  # records over the context after scaling
    scaling: TraceScaling

    @property
    def kept(self) -> int:
        return len(self.requests)


def scale_trace(records: Iterable[TraceRecord], scaling: TraceScaling | None = None) -> ScaledTrace:
    """Apply ``scaling`` to every record; those that do not fit the context are dropped."""
    scaling = scaling or TraceScaling()
    content = BlockContent(scaling.seed, scaling.block_tokens, scaling.vocab_size, scaling.first_token_id)
    requests, dropped = [], 0
    for index, record in enumerate(records):
        prompt, output = scaling.prompt_tokens(record), scaling.output_tokens(record)
        if prompt + output > scaling.max_context_tokens:
            dropped += 1
            continue
        requests.append(TraceRequest(index, scaling.arrival_seconds(record), prompt, output,
                                     tuple(record.hash_ids), content))
    return ScaledTrace(requests, dropped, scaling)


def load_trace(path: str | Path, scaling: TraceScaling | None = None, limit: int | None = None) -> ScaledTrace:
    """``read_trace`` then ``scale_trace``: the first ``limit`` records of the file, scaled."""
    return scale_trace(read_trace(path, limit), scaling)
