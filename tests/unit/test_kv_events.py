"""Contract: what vLLM's own KV-event classes encode, foundation.kv_events decodes.

Batches are built with ``vllm.distributed.kv_events`` and encoded exactly as vLLM's
publisher does (``msgspec.msgpack.Encoder().encode(batch)``); the frames of vLLM's real
ZmqEventPublisher are decoded in tests/contract/test_kv_events_publisher.py.
"""

from __future__ import annotations

import msgspec
import pytest

from foundation import kv_events
from foundation.kv_events import KVEventDecodeError, decode_batch, decode_frames, salt_of, stored_blocks
from foundation.netutil import free_port

vllm_events = pytest.importorskip("vllm.distributed.kv_events")

SALT = "kvr1-0123456789abcdef0123456789abcdef"
TOPIC = b"kv-events"


def vllm_stored(hashes, parent, tokens, block_size, *, lora_name=None, lora_id=None, extra_keys=None,
                medium="GPU", **more):
    return vllm_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                   block_size=block_size, lora_id=lora_id, medium=medium,
                                   lora_name=lora_name, extra_keys=extra_keys, **more)


def vllm_batch(events, ts=123.5, rank=None) -> bytes:
    return msgspec.msgpack.encode(vllm_events.KVEventBatch(ts=ts, events=events, data_parallel_rank=rank))


def frames(seq: int, payload: bytes, topic: bytes = TOPIC) -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload]


# ---------------------------------------------------------------- decoding vLLM's encoding


def test_decode_bytes_hashes_with_salt():
    h = [bytes([i]) * 32 for i in range(3)]
    payload = vllm_batch([vllm_stored(h, None, list(range(12)), 4,
                                      extra_keys=[(SALT,), None, None])])
    batch = decode_batch(payload)
    assert batch.ts == 123.5
    assert batch.data_parallel_rank is None
    [event] = batch.events
    assert isinstance(event, kv_events.BlockStored)
    assert event.block_hashes == h
    assert event.parent_block_hash is None
    assert event.token_ids == list(range(12))
    assert event.block_size == 4
    assert event.medium == "GPU"
    assert event.lora_name is None and event.lora_id is None
    assert [tuple(k) if k else None for k in event.extra_keys] == [(SALT,), None, None]


def test_decode_int_hashes_including_full_64_bit_range():
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: hashes are 64-bit unsigned ints.
    h = [(1 << 64) - 1, 1 << 63, 7]
    parent = (1 << 64) - 2
    payload = vllm_batch([vllm_stored(h, parent, list(range(6)), 2)], rank=0)
    batch = decode_batch(payload)
    [event] = batch.events
    assert event.block_hashes == h
    assert event.parent_block_hash == parent
    assert event.extra_keys is None
    assert batch.data_parallel_rank == 0


def test_decode_removed_and_cleared_in_one_batch():
    payload = vllm_batch([
        vllm_stored([11, 12], None, [1, 2, 3, 4], 2),
        vllm_events.BlockRemoved(block_hashes=[12, b"\x01" * 32], medium="GPU"),
        vllm_events.AllBlocksCleared(),
    ])
    events = decode_batch(payload).events
    assert [type(e) for e in events] == [kv_events.BlockStored, kv_events.BlockRemoved,
                                         kv_events.AllBlocksCleared]
    assert events[1].block_hashes == [12, b"\x01" * 32]
    assert events[1].medium == "GPU"


def test_decode_lora_event_with_lora_name_first_in_extra_keys():
    extra = [("sql-lora", SALT), ("sql-lora",)]
    payload = vllm_batch([vllm_stored([1, 2], None, [5, 6, 7, 8], 2, lora_name="sql-lora", lora_id=3,
                                      extra_keys=extra)])
    [event] = decode_batch(payload).events
    assert event.lora_name == "sql-lora"
    assert event.lora_id == 3
    records = list(stored_blocks(event))
    assert records[0].extra_keys == ("sql-lora", SALT)
    assert records[1].extra_keys == ("sql-lora",)
    assert salt_of(records[0].extra_keys, event.lora_name) == SALT
    assert salt_of(records[1].extra_keys, event.lora_name) is None


def test_decode_ignores_fields_vllm_added_later():
    # vLLM 0.32 carries group_idx, cache-spec kind, locality, ownership, session_id.
    payload = vllm_batch([
        vllm_stored([1], None, [1, 2], 2, extra_keys=[(SALT,)], group_idx=0, kv_cache_spec_kind="full",
                    kv_cache_spec_sliding_window=None, locality="LOCAL", ownership="x", session_id="s"),
        vllm_events.BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0, locality="LOCAL"),
    ])
    stored, removed = decode_batch(payload).events
    assert stored.block_hashes == [1] and salt_of(tuple(stored.extra_keys[0])) == SALT
    assert removed.block_hashes == [1]


def test_decode_multimodal_and_prompt_embeds_extra_keys_keep_salt_recognisable():
    # vLLM's order: LoRA name, (mm_identifier, offset) pairs, cache salt, prompt-embeds digests.
    extra = [("sql-lora", ("img-abc", 0), ("img-def", 3), SALT, b"\x00" * 32)]
    payload = vllm_batch([vllm_stored([9], None, [1, 2, 3, 4], 4, lora_name="sql-lora", extra_keys=extra)])
    [event] = decode_batch(payload).events
    [record] = stored_blocks(event)
    assert salt_of(record.extra_keys, event.lora_name) == SALT
    extra = [(("img-abc", 0), SALT)]
    [event] = decode_batch(vllm_batch([vllm_stored([9], None, [1, 2, 3, 4], 4, extra_keys=extra)])).events
    assert salt_of(next(stored_blocks(event)).extra_keys) == SALT


def test_decode_frames_reads_big_endian_sequence_number():
    payload = vllm_batch([vllm_events.AllBlocksCleared()])
    for seq in (0, 1, 255, 256, 2**40 + 3):
        got_seq, batch = decode_frames(frames(seq, payload))
        assert got_seq == seq
        assert isinstance(batch.events[0], kv_events.AllBlocksCleared)


# ---------------------------------------------------------------- stored_blocks


def test_stored_blocks_splits_and_chains_parents():
    event = decode_batch(vllm_batch([vllm_stored([b"a", b"b", b"c"], b"p", list(range(9)), 3,
                                                 extra_keys=None)])).events[0]
    records = list(stored_blocks(event))
    assert [r.engine_hash for r in records] == [b"a", b"b", b"c"]
    assert [r.parent for r in records] == [b"p", b"a", b"b"]
    assert [r.token_ids for r in records] == [(0, 1, 2), (3, 4, 5), (6, 7, 8)]
    assert all(r.extra_keys is None for r in records)


def test_stored_blocks_first_block_of_a_chain_has_no_parent_and_carries_the_salt():
    event = decode_batch(vllm_batch([vllm_stored([10, 11], None, [1, 2, 3, 4], 2,
                                                 extra_keys=[(SALT,), None])])).events[0]
    first, second = stored_blocks(event)
    assert first.parent is None and first.extra_keys == (SALT,)
    assert second.parent == 10 and second.extra_keys is None
    assert isinstance(first.token_ids, tuple)


def test_stored_blocks_with_short_extra_keys_list():
    event = kv_events.BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=list(range(6)),
                                  block_size=2, extra_keys=[[SALT]])
    records = list(stored_blocks(event))
    assert [r.extra_keys for r in records] == [(SALT,), None, None]


# ---------------------------------------------------------------- salt_of


def test_salt_of_without_lora():
    assert salt_of((SALT,)) == SALT
    assert salt_of((SALT,), None) == SALT
    assert salt_of(None) is None
    assert salt_of(()) is None
    assert salt_of((("img", 0),)) is None  # mm pairs are not salts
    assert salt_of((b"\x00" * 32,)) is None  # prompt-embeds digests are not salts


def test_salt_of_with_lora():
    assert salt_of(("sql-lora", SALT), "sql-lora") == SALT
    assert salt_of(("sql-lora",), "sql-lora") is None  # LoRA without a salt
    assert salt_of(("sql-lora", ("img", 0), SALT, b"d"), "sql-lora") == SALT


def test_salt_of_lora_name_unknown_still_finds_the_salt():
    # A snapshot (wire.ResidentBlock) carries extra keys but not the LoRA name: the
    # salt, listed after the LoRA name, must still be the one found.
    assert salt_of(("sql-lora", SALT)) == SALT
    assert salt_of(("sql-lora", ("img", 0), SALT, b"d")) == SALT


# ---------------------------------------------------------------- malformed input


@pytest.mark.parametrize("bad", [
    [],
    [TOPIC],
    [TOPIC, (1).to_bytes(8, "big")],
    [TOPIC, (1).to_bytes(4, "big"), vllm_batch([])],
    [TOPIC, (1).to_bytes(9, "big"), vllm_batch([])],
    [TOPIC, (1).to_bytes(8, "big"), vllm_batch([]), b"extra"],
])
def test_malformed_frame_shapes_raise(bad):
    with pytest.raises(KVEventDecodeError):
        decode_frames(bad)


@pytest.mark.parametrize("payload", [
    b"",
    b"\xc1",  # never-used msgpack byte
    b"not msgpack at all",
    msgspec.msgpack.encode({"ts": 1.0, "events": []}),  # a map, not vLLM's array
    msgspec.msgpack.encode([1.0, [{"type": "BlockExploded", "block_hashes": [1]}]]),  # unknown tag
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),  # missing fields
    msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["str-hash"]}]]),
    msgspec.msgpack.encode(["yesterday", []]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 7}]]),
    b"\x92\xcb" + b"\x00" * 8 + b"\x91\x81\xa4type\xa3\xff\xfe\xfd",  # invalid UTF-8 in a string
    b"\x92\xcb" + b"\x00" * 8 + b"\x91" * 2000,  # deeply nested
    vllm_batch([vllm_events.AllBlocksCleared()])[:-1],  # truncated
])
def test_malformed_payloads_raise(payload):
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)
    with pytest.raises(KVEventDecodeError):
        decode_frames(frames(0, payload))


def test_vllm_binds_only_wildcard_endpoints():
    # Pins the vLLM behaviour kvroute's worker configuration depends on.
    bind = vllm_events.ZmqEventPublisher._is_bind_endpoint
    assert bind("tcp://*:5557")
    assert bind("ipc:///tmp/kv-events")
    assert not bind("tcp://127.0.0.1:5557")
    assert not bind("tcp://0.0.0.0:5557")


def test_worker_kv_events_endpoint_is_a_private_one_vllm_binds():
    # With tcp://<host>:<port> vLLM would connect its PUB socket, nobody would bind the
    # port, and no subscriber would see an event; a tcp port would publish prompts in clear.
    from worker.engine import kv_events_config
    from worker.settings import WorkerSettings

    settings = WorkerSettings(role="prefill", model="m", kv_events_port=free_port(),
                              kv_events_local_address="ipc:///tmp/kvroute-events-x/events")
    endpoint = kv_events_config(settings).endpoint
    assert endpoint == "ipc:///tmp/kvroute-events-x/events"
    assert vllm_events.ZmqEventPublisher._is_bind_endpoint(endpoint), endpoint


def test_worker_kv_events_refuse_a_tcp_endpoint():
    from worker.engine import kv_events_config
    from worker.settings import WorkerSettings

    for address in ("", "tcp://*:5557"):
        settings = WorkerSettings(role="prefill", model="m", kv_events_local_address=address)
        with pytest.raises(ValueError, match="private ipc"):
            kv_events_config(settings)


def test_decode_error_is_a_value_error():
    assert issubclass(KVEventDecodeError, ValueError)
