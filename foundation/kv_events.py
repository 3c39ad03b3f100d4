"""vLLM's KV-event stream, as kvroute reads it.

vLLM publishes ``KVEventBatch`` messages on a ZMQ PUB socket as frames
``(topic, 8-byte big-endian sequence number, msgpack payload)``. These structs mirror
vLLM's own definitions (``vllm.distributed.kv_events``) so the orchestrator can decode
them without importing vLLM; a contract test encodes with vLLM's classes and decodes
with these. Sequence numbers restart with every engine process.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

EngineHash = bytes | int


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=False):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=False):
    block_hashes: list[EngineHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


class KVEventDecodeError(ValueError):
    pass


def decode_batch(payload: bytes) -> KVEventBatch:
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError) as error:
        raise KVEventDecodeError(str(error)) from error


def decode_frames(frames: list[bytes]) -> tuple[int, KVEventBatch]:
    """(sequence number, batch) of one published message."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise KVEventDecodeError(f"expected (topic, seq, payload), got {len(frames)} frames")
    return int.from_bytes(frames[1], "big"), decode_batch(frames[2])


@dataclass(frozen=True)
class StoredBlockRecord:
    """One stored block: its engine hash, its parent's, its tokens, its extra keys."""

    engine_hash: EngineHash
    parent: EngineHash | None
    token_ids: tuple[int, ...]
    extra_keys: tuple | None


def stored_blocks(event: BlockStored) -> Iterator[StoredBlockRecord]:
    """Split a BlockStored event (several chained blocks) into per-block records."""
    parent = event.parent_block_hash
    size = event.block_size
    for index, engine_hash in enumerate(event.block_hashes):
        extra = event.extra_keys[index] if event.extra_keys and index < len(event.extra_keys) else None
        tokens = tuple(event.token_ids[index * size:(index + 1) * size])
        yield StoredBlockRecord(engine_hash, parent, tokens, tuple(extra) if extra else None)
        parent = engine_hash


def salt_of(extra_keys: tuple | None, lora_name: str | None = None) -> str | None:
    """The cache salt among a first block's extra keys.

    vLLM lists the LoRA name first and the salt as the last string (multimodal keys are
    pairs, prompt-embeds digests bytes), so the salt is found even when the LoRA name
    is not known, as in a snapshot.
    """
    strings = [key for key in (extra_keys or ()) if isinstance(key, str)]
    if lora_name and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[-1] if strings else None
