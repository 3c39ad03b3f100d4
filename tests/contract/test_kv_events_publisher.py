"""vLLM's real ZmqEventPublisher, on a socket: the frames it publishes decode with
foundation.kv_events, in order and without gaps."""

from __future__ import annotations

import time

import pytest
import zmq

from foundation import kv_events
from foundation.kv_events import decode_frames, salt_of, stored_blocks
from foundation.netutil import free_port, tcp

vllm_events = pytest.importorskip("vllm.distributed.kv_events")

SALT = "kvr1-0123456789abcdef0123456789abcdef"
TOPIC = b"kv-events"


def vllm_stored(hashes, parent, tokens, block_size, *, extra_keys=None):
    return vllm_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                   block_size=block_size, lora_id=None, medium="GPU", lora_name=None,
                                   extra_keys=extra_keys)


def test_real_vllm_publisher_frames_decode():
    port = free_port()
    # vLLM binds only wildcard (or ipc/inproc) endpoints; a concrete host makes it connect.
    publisher = vllm_events.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}",
                                              replay_endpoint=None, topic=TOPIC.decode())
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(tcp("127.0.0.1", port))
    try:
        received: list[list[bytes]] = []
        deadline = time.monotonic() + 10
        # Slow joiner: keep publishing until the subscriber sees something.
        while not received and time.monotonic() < deadline:
            publisher.publish(vllm_events.KVEventBatch(ts=time.time(), events=[
                vllm_stored([b"\x07" * 32, 42], None, [1, 2, 3, 4], 2, extra_keys=[(SALT,), None])]))
            if sub.poll(200):
                received.append(sub.recv_multipart())
        assert received, "no frames from vLLM's publisher"
        publisher.publish(vllm_events.KVEventBatch(ts=time.time(), events=[
            vllm_events.BlockRemoved(block_hashes=[42], medium="GPU")]))
        while sub.poll(1000):
            received.append(sub.recv_multipart())
            if isinstance(decode_frames(received[-1])[1].events[0], kv_events.BlockRemoved):
                break
        decoded = [decode_frames(f) for f in received]
        assert all(f[0] == TOPIC for f in received)
        seqs = [seq for seq, _ in decoded]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert seqs[-1] == seqs[-2] + 1
        seq, batch = decoded[0]
        assert batch.data_parallel_rank == 0
        [record0, record1] = stored_blocks(batch.events[0])
        assert record0.engine_hash == b"\x07" * 32 and record1.parent == b"\x07" * 32
        assert salt_of(record0.extra_keys) == SALT
        assert decoded[-1][1].events[0].block_hashes == [42]
    finally:
        sub.close(linger=0)
        context.term()
        publisher.shutdown()
