"""Mooncake trace parsing and scaling: lengths, sharing, time, the context filter, content."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from workloads.tokens import FIRST_ORDINARY_ID, pseudo_token_ids
from workloads.trace import (
    BlockContent,
    TraceFormatError,
    TraceRecord,
    TraceScaling,
    load_trace,
    parse_record,
    read_trace,
    sample_families,
    scale_trace,
)

SYNTHETIC = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"

# Two requests share blocks 0 and 1; the third shares only block 0; the fourth nothing.
TINY = [
    {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 1024, "output_length": 20, "hash_ids": [0, 1]},
    {"timestamp": 1250, "input_length": 700, "output_length": 5, "hash_ids": [0, 3]},
    {"timestamp": 3000, "input_length": 13, "output_length": 1, "hash_ids": [4]},
]


def write_trace(tmp_path: Path, rows: list[dict], extra_lines: tuple[str, ...] = ()) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join([json.dumps(row) for row in rows] + list(extra_lines)) + "\n")
    return path


def tiny_trace(tmp_path: Path, **scaling):
    return load_trace(write_trace(tmp_path, TINY), TraceScaling(**scaling))


def test_reads_records_in_file_order_and_skips_blank_lines(tmp_path):
    records = read_trace(write_trace(tmp_path, TINY, ("", "  ")))
    assert records == [TraceRecord(**row) for row in TINY]
    assert read_trace(write_trace(tmp_path, TINY), limit=2) == records[:2]


@pytest.mark.parametrize("line", [
    '{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1]}',  # needs 3 ids
    '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
    '{"timestamp": 0, "input_length": 10}',
    'not json',
])
def test_malformed_records_are_refused(line):
    with pytest.raises(TraceFormatError):
        parse_record(line, 7)


def test_unknown_fields_are_ignored():
    record = parse_record('{"timestamp": 1, "input_length": 5, "output_length": 2, "hash_ids": [9], "x": 1}')
    assert record.hash_ids == [9]


@pytest.mark.parametrize("input_length, blocks, block_tokens, expected", [
    (1100, 3, 64, 2 * 64 + 10),  # last block 76 tokens -> ceil(76 / 8) = 10
    (1024, 2, 64, 128),  # full blocks stay full
    (13, 1, 64, 2),  # a tiny prompt keeps at least one token per started block
    (1100, 3, 512, 1100),  # no scaling
    (1100, 3, 16, 2 * 16 + 3),
])
def test_length_scaling_keeps_the_block_structure(input_length, blocks, block_tokens, expected):
    record = TraceRecord(0, input_length, 1, list(range(blocks)))
    assert TraceScaling(block_tokens=block_tokens).prompt_tokens(record) == expected


def test_time_and_output_scaling(tmp_path):
    trace = tiny_trace(tmp_path, time_scale=2.0, output_scale=0.5)
    assert [r.arrival_seconds for r in trace.requests] == [0.0, 1.0, 2.5, 6.0]
    assert [r.max_tokens for r in trace.requests] == [5, 10, 3, 1]  # rounded up, at least one


def test_requests_over_the_context_are_dropped_and_counted(tmp_path):
    trace = tiny_trace(tmp_path, max_context_tokens=100)  # prompts 138, 128, 88 (+5 out), 2 (+1)
    assert [r.index for r in trace.requests] == [2, 3]  # original positions survive the drop
    assert trace.dropped == 2 and trace.kept == 2


def test_shared_hash_ids_share_exactly_their_tokens(tmp_path):
    first, second, third, fourth = tiny_trace(tmp_path).requests
    a, b, c, d = (r.prompt_token_ids for r in (first, second, third, fourth))
    assert [len(x) for x in (a, b, c, d)] == [138, 128, 88, 2]
    assert a[:128] == b  # blocks 0 and 1
    assert a[:64] == c[:64] and a[64:88] != c[64:88]  # block 0 only
    assert not set(d) & set(a[:2])
    assert all(FIRST_ORDINARY_ID <= t < 49_152 for t in a + b + c + d)


def test_last_block_is_the_head_of_its_full_block():
    content = BlockContent(seed=3, block_tokens=64)
    assert content.token_ids([5, 6], 64 + 10) == content.block(5) + content.block(6)[:10]


def test_content_depends_on_the_seed_only(tmp_path):
    same = tiny_trace(tmp_path).requests[0].prompt_token_ids
    assert same == tiny_trace(tmp_path).requests[0].prompt_token_ids
    assert same != tiny_trace(tmp_path, seed=1).requests[0].prompt_token_ids


def test_pseudo_token_ids_are_stable_and_prefix_consistent():
    assert pseudo_token_ids(b"x", 8) == pseudo_token_ids(b"x", 20)[:8]
    assert pseudo_token_ids(b"x", 8) != pseudo_token_ids(b"y", 8)
    assert pseudo_token_ids(b"x", 0) == []


def test_scale_trace_accepts_records_directly():
    trace = scale_trace([TraceRecord(**row) for row in TINY])
    assert trace.kept == 4 and trace.scaling == TraceScaling()


@pytest.mark.skipif(not SYNTHETIC.exists(), reason="shared/data not present")
def test_the_synthetic_trace_at_the_default_scaling():
    records = read_trace(SYNTHETIC)
    trace = scale_trace(records)
    assert len(records) == 3993
    too_long = sum(1 for r in records if TraceScaling().prompt_tokens(r) + r.output_length > 8192)
    assert trace.dropped == too_long == 47
    assert all(r.prompt_tokens + r.max_tokens <= 8192 for r in trace.requests)
    assert all(math.ceil(r.prompt_tokens / 64) == len(r.hash_ids) for r in trace.requests)
    arrivals = [r.arrival_seconds for r in trace.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] == pytest.approx(1022.025)


def family_records(families: int, per_family: int) -> list[TraceRecord]:
    """``per_family`` records of each family, interleaved in time; ids chained per family."""
    return [TraceRecord(timestamp=10 * (k * families + f), input_length=600, output_length=3,
                        hash_ids=[1000 * f, 1000 * f + 1 + k])
            for k in range(per_family) for f in range(families)]


def test_sampled_families_are_whole_in_trace_order_and_seeded():
    records = family_records(families=400, per_family=3)
    sample = sample_families(records, 0.25, seed=7)
    kept = {r.hash_ids[0] for r in sample}
    assert 60 <= len(kept) <= 140  # a quarter of 400 families, give or take chance
    assert sample == [r for r in records if r.hash_ids[0] in kept]  # every record of a kept family, in order
    assert sample_families(records, 0.25, seed=7) == sample
    assert {r.hash_ids[0] for r in sample_families(records, 0.25, seed=8)} != kept
    assert sample_families(records, 1.0) == records


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_family_fraction_outside_zero_to_one_is_refused(fraction):
    with pytest.raises(ValueError, match="fraction"):
        sample_families(family_records(2, 2), fraction)


@pytest.mark.skipif(not SYNTHETIC.exists(), reason="shared/data not present")
def test_a_family_sample_of_the_synthetic_trace_keeps_its_span_and_its_sharing():
    """The first 111 records share 5% of their tokens; 2% of the families, about as many
    records, share more than half, over the whole trace's span."""
    from kvroute.bench.oracle import oracle_requests, unlimited_reuse

    records = read_trace(SYNTHETIC)
    scaling = TraceScaling(block_tokens=32, max_context_tokens=4096)
    sample, head = scale_trace(sample_families(records, 0.02), scaling), scale_trace(records[:111], scaling)
    assert 80 <= sample.kept <= 140
    assert sample.requests[-1].arrival_seconds > 1000
    reuse = lambda trace: unlimited_reuse(oracle_requests(trace.requests, 32), 32).hit_rate  # noqa: E731
    assert reuse(sample) > 0.5 > 0.1 > reuse(head)
