"""Requests for the simulator's engine, and the synthetic Mooncake trace (in shared/data,
beside the checkout; tests that need it skip without it)."""

from __future__ import annotations

from pathlib import Path

from foundation import identity
from simulator.sequence import EngineRequest

SYNTHETIC = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
BLOCK = 16


def tokens(label: int, count: int) -> list[int]:
    return [1000 + label * 10_000 + i for i in range(count)]


def engine_request(request_id: str, token_ids: list[int], max_tokens: int = 1, **fields) -> EngineRequest:
    return EngineRequest(request_id, token_ids, identity.block_hashes(token_ids, BLOCK, None), max_tokens, **fields)
