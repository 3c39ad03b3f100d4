"""Contract suite of the transfer endpoint: a real BlockServer on 127.0.0.1 serving a
fake paged KV cache, driven through block_client as a consumer engine would.

Parametrized over KV dtypes and layouts (block dimension first or second).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

import pytest
import torch
import zmq

from foundation import wire
from foundation.endpoint_client import PullFailed, fetch_transfer_stats, release_lease
from foundation.netutil import free_port, tcp
from foundation.zmq_auth import secure_client
from tests.contract.transfer_endpoint import (
    PARK_SECONDS,
    Producer,
    assert_pulled,
    assert_untouched,
    pull_into,
    stage,
)
from tests.paged_caches import (
    BLOCK_SIZE,
    CONSUMER_BLOCKS,
    DTYPES,
    LAYOUTS,
    NUM_LAYERS,
    PRODUCER_BLOCKS,
    block_bytes,
    make_cache,
    snapshot,
)
from transfer.kv_layout import block_index_tensor
from transfer.leases import Lease

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=list(DTYPES))
def dtype_name(request):
    return request.param


@pytest.fixture(params=list(LAYOUTS))
def layout(request):
    return request.param


@pytest.fixture
def dtype(dtype_name):
    return DTYPES[dtype_name]


@pytest.fixture
def producer(dtype, layout):
    with Producer(dtype, layout).serving() as producer:
        yield producer


@pytest.fixture
def consumer(dtype, layout):
    return make_cache(dtype, layout, CONSUMER_BLOCKS, seed=None)


# ---------------------------------------------------------------- pulls


def test_delta_pull_is_bit_exact_and_writes_only_the_requested_blocks(producer, consumer, context):
    lease_blocks = (3, 7, 1, 10, 5)
    _, source = producer.lease(lease_blocks)
    before = snapshot(producer.cache)
    positions = [1, 3, 4]  # positions 0 and 2 are already cached locally
    local_ids = [0, 4, 8]

    nbytes = pull_into(context, consumer, source, positions, local_ids)

    assert nbytes == len(positions) * consumer.spec.bytes_per_block
    assert_pulled(producer, consumer, [lease_blocks[p] for p in positions], local_ids)
    for layer, original in zip(producer.cache.layers, before):  # the producer only read
        assert torch.equal(layer.view(torch.uint8), original.view(torch.uint8))
    assert len(producer.leases) == 1  # a pull does not end the lease; the release does


def test_full_pull_in_lease_order(producer, consumer, context):
    lease_blocks = tuple(range(PRODUCER_BLOCKS - 1, PRODUCER_BLOCKS - 1 - 9, -1))  # 11, 10, … 3
    _, source = producer.lease(lease_blocks)
    local_ids = [9, 0, 1, 2, 3, 4, 5, 6, 7]
    nbytes = pull_into(context, consumer, source, range(len(lease_blocks)), local_ids)
    assert nbytes == len(lease_blocks) * consumer.spec.bytes_per_block
    assert_pulled(producer, consumer, lease_blocks, local_ids)


def test_pull_of_a_single_block_small_frames(producer, consumer, context):
    """Below the zero-copy threshold the server copies; the contract is the same."""
    lease_blocks = (6,)
    _, source = producer.lease(lease_blocks)
    assert producer.cache.layer_bytes_per_block < 64 * 1024
    assert pull_into(context, consumer, source, [0], [5]) == consumer.spec.bytes_per_block
    assert_pulled(producer, consumer, [6], [5])


def test_repeated_pulls_of_one_lease_are_identical(producer, context, dtype, layout):
    lease_blocks = (2, 4, 6, 8)
    _, source = producer.lease(lease_blocks)
    for _ in range(3):
        consumer = make_cache(dtype, layout, CONSUMER_BLOCKS, seed=None)
        pull_into(context, consumer, source, [0, 1, 2, 3], [0, 1, 2, 3])
        assert_pulled(producer, consumer, lease_blocks, [0, 1, 2, 3])


def test_concurrent_pulls(producer, context, dtype, layout):
    leases = [producer.lease((i, (i + 3) % PRODUCER_BLOCKS, (i + 7) % PRODUCER_BLOCKS)) for i in range(6)]
    consumers = [make_cache(dtype, layout, CONSUMER_BLOCKS, seed=None) for _ in leases]
    errors: list[BaseException] = []

    def run(index: int):
        try:
            pull_into(context, consumers[index], leases[index][1], [0, 1, 2], [7, 1, 4])
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(leases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    for (lease, _), consumer in zip(leases, consumers):
        assert_pulled(producer, consumer, lease.block_ids, [7, 1, 4])


# ---------------------------------------------------------------- parking


def test_unknown_handle_is_refused_after_park_seconds(producer, consumer, context):
    source = producer.source(secrets.token_hex(16))
    started = time.monotonic()
    with pytest.raises(PullFailed, match="unknown or expired"):
        pull_into(context, consumer, source, [0], [0])
    elapsed = time.monotonic() - started
    assert PARK_SECONDS * 0.9 <= elapsed < PARK_SECONDS + 1.0
    assert_untouched(consumer)


def test_pull_before_the_lease_is_granted_waits_for_it(producer, consumer, context):
    lease_blocks = (9, 0, 4)
    lease, source = producer.lease(lease_blocks, grant=False)
    timer = threading.Timer(0.1, producer.leases.grant, args=(lease,))
    started = time.monotonic()
    timer.start()
    try:
        nbytes = pull_into(context, consumer, source, [0, 1, 2], [3, 4, 5])
    finally:
        timer.cancel()
    assert time.monotonic() - started >= 0.09
    assert nbytes == 3 * consumer.spec.bytes_per_block
    assert_pulled(producer, consumer, lease_blocks, [3, 4, 5])


def test_client_that_gives_up_while_parked_does_not_stall_the_server(producer, consumer, context):
    source = producer.source(secrets.token_hex(16))
    with pytest.raises(PullFailed, match="deadline"):
        pull_into(context, consumer, source, [0], [0], deadline_seconds=0.1)
    _, good = producer.lease((1, 2))
    assert pull_into(context, consumer, good, [0, 1], [0, 1]) == 2 * consumer.spec.bytes_per_block
    assert_pulled(producer, consumer, [1, 2], [0, 1])


# ---------------------------------------------------------------- refusals


def test_layout_mismatch_is_refused(producer, context, dtype_name, layout):
    lease, source = producer.lease((1, 2, 3))
    other_dtype = DTYPES["float32" if dtype_name == "bfloat16" else "bfloat16"]
    other_layout = "block-dim-1" if layout == "block-dim-0" else "block-dim-0"
    for foreign in (make_cache(other_dtype, layout, CONSUMER_BLOCKS, seed=None),
                    make_cache(DTYPES[dtype_name], other_layout, CONSUMER_BLOCKS, seed=None)):
        with pytest.raises(PullFailed, match="layouts differ, refusing the pull: (dtype|block_dim)"):
            pull_into(context, foreign, source, [0, 1], [0, 1])
        assert_untouched(foreign)
    assert producer.leases.get(lease.handle) is lease  # a refused pull leaves the lease alone


@pytest.mark.parametrize("indices", [[3], [0, 3], [-1], [0, 1, 2, 99]], ids=str)
def test_out_of_range_indices_are_refused(producer, consumer, context, indices):
    lease, source = producer.lease((1, 2, 3))
    with pytest.raises(PullFailed, match="outside the lease"):
        pull_into(context, consumer, source, indices, list(range(len(indices))))
    assert_untouched(consumer)
    assert producer.leases.get(lease.handle) is lease
    assert producer.counters.snapshot().bytes_sent == 0


def test_expired_lease_is_refused_at_once(producer, consumer, context):
    lease, source = producer.lease((4, 5))
    assert producer.leases.expire(now=lease.expires_at) == [lease]
    started = time.monotonic()
    with pytest.raises(PullFailed, match="expired before this pull"):
        pull_into(context, consumer, source, [0, 1], [0, 1])
    assert time.monotonic() - started < PARK_SECONDS, "an expired handle was parked like an unknown one"
    assert producer.leases.take_ended_request_ids() == {lease.request_id}
    assert_untouched(consumer)


def test_the_server_expires_leases_on_its_own_clock(producer, context):
    """No engine step is needed: an idle engine never steps, and a staged lease lets it idle."""
    handle = secrets.token_hex(16)
    producer.leases.grant(Lease(handle=handle, request_id="req-due", block_ids=(1,), num_tokens=BLOCK_SIZE,
                                expires_at=time.monotonic() + 0.2))
    deadline = time.monotonic() + 3
    while producer.leases.get(handle) is not None:
        assert time.monotonic() < deadline, "the server never expired a lease that was due"
        time.sleep(0.02)
    assert producer.leases.take_ended_request_ids() == {"req-due"}
    counters = fetch_transfer_stats(context, producer.address).counters
    assert counters.leases_expired == 1 and counters.active_leases == 0


def test_an_expiry_says_whether_the_lease_was_pulled(producer, consumer, context, caplog):
    """A pulled lease that expires lost its acknowledgement; an unpulled one, its consumer."""
    caplog.set_level(logging.WARNING, logger="kvroute.transfer.server")
    expires_at = time.monotonic() + 0.5
    pulled = Lease(handle=secrets.token_hex(16), request_id="req-pulled", block_ids=(1,), num_tokens=BLOCK_SIZE,
                   expires_at=expires_at)
    unpulled = Lease(handle=secrets.token_hex(16), request_id="req-unpulled", block_ids=(2,),
                     num_tokens=BLOCK_SIZE, expires_at=expires_at)
    producer.leases.grant(pulled)
    producer.leases.grant(unpulled)
    pull_into(context, consumer, producer.source(pulled.handle), [0], [0])
    expected = {"lease for request req-pulled was pulled but never acknowledged; freeing its blocks at expiry",
                "lease for request req-unpulled expired unpulled; freeing its blocks"}
    deadline = time.monotonic() + 3
    # The server thread ends the leases, then logs why: wait for the lines, not the table.
    while not expected <= {record.getMessage() for record in caplog.records}:
        assert time.monotonic() < deadline, f"the server never logged both expiries: {caplog.text}"
        time.sleep(0.02)
    assert len(producer.leases) == 0


# ---------------------------------------------------------------- release and stats


def test_release_lease(producer, consumer, context):
    lease, source = producer.lease((4, 5, 6), request_id="req-release")
    other, _ = producer.lease((7,), request_id="req-other")
    assert release_lease(context, producer.address, lease.handle, "ack") is True
    assert producer.leases.get(lease.handle) is None
    assert producer.leases.get(other.handle) is other
    assert producer.leases.take_ended_request_ids() == {"req-release"}
    assert release_lease(context, producer.address, lease.handle, "ack") is False
    assert release_lease(context, producer.address, secrets.token_hex(16), "abort") is False
    assert producer.leases.take_ended_request_ids() == set()
    # Released blocks are no longer served.
    with pytest.raises(PullFailed, match="unknown or expired"):
        pull_into(context, consumer, source, [0], [0])
    assert_untouched(consumer)


def test_transfer_stats_match_what_happened(producer, consumer, context):
    first, first_source = producer.lease((0, 1, 2, 3))
    second, second_source = producer.lease((8, 9))
    producer.lease((10,))
    received = pull_into(context, consumer, first_source, [1, 2], [0, 1])
    received += pull_into(context, consumer, second_source, [0, 1], [2, 3])
    with pytest.raises(PullFailed):
        pull_into(context, consumer, first_source, [7], [4])
    assert release_lease(context, producer.address, first.handle, "ack")
    assert len(producer.leases.expire(now=time.monotonic() + 120)) == 2  # the other two

    reply = fetch_transfer_stats(context, producer.address)

    assert isinstance(reply, wire.TransferStatsReply)
    assert reply.layout == producer.cache.spec == consumer.spec
    counters = reply.counters
    assert counters.bytes_sent == received == 4 * consumer.spec.bytes_per_block
    assert counters.blocks_sent == 4
    assert counters.leases_granted == 3
    assert counters.leases_released == 1
    assert counters.leases_expired == 2
    assert counters.active_leases == 0
    # Receiving counters belong to the consumer's connector, not to this endpoint.
    assert counters.bytes_received == 0 and counters.pulls_ok == 0


def test_fresh_endpoint_reports_zero_counters(producer, context):
    reply = fetch_transfer_stats(context, producer.address)
    assert reply.counters == wire.TransferCounters()
    assert reply.layout == producer.cache.spec


# ---------------------------------------------------------------- dead peers


@pytest.mark.parametrize("deadline_seconds", [0.3, 1.0])
def test_pull_from_nobody_fails_by_its_deadline(context, consumer, deadline_seconds):
    address = tcp("127.0.0.1", free_port())  # nobody listens here
    source = wire.PullSource(handle=secrets.token_hex(16), address=address, num_tokens=16, block_size=BLOCK_SIZE)
    started = time.monotonic()
    with pytest.raises(PullFailed, match="deadline"):
        pull_into(context, consumer, source, [0], [0], deadline_seconds=deadline_seconds)
    elapsed = time.monotonic() - started
    assert deadline_seconds * 0.9 <= elapsed < deadline_seconds + 1.0
    assert_untouched(consumer)


def test_release_and_stats_against_nobody(context):
    address = tcp("127.0.0.1", free_port())
    started = time.monotonic()
    assert release_lease(context, address, secrets.token_hex(16), "ack", timeout=0.3) is False
    with pytest.raises(PullFailed):
        fetch_transfer_stats(context, address, timeout=0.3)
    assert time.monotonic() - started < 0.6 + 1.0


# ---------------------------------------------------------------- malformed input


def _exchange(context, address: str, frames: list[bytes]) -> wire.Message:
    socket = secure_client(context.socket(zmq.DEALER), "worker", transfer=True)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    try:
        socket.send_multipart(frames)
        assert socket.poll(5000), "the server did not answer"
        reply = socket.recv_multipart()
        assert len(reply) == 1
        return wire.decode(reply[0])
    finally:
        socket.close(linger=0)


MALFORMED = [
    pytest.param([b"\xc1\x00garbage"], "bad_request", id="garbage"),
    pytest.param([b""], "bad_request", id="empty-frame"),
    pytest.param([wire.encode(wire.TransferStatsRequest()), b"extra"], "bad_request", id="multi-frame"),
    pytest.param([b"a", b"b", b"c"], "bad_request", id="three-frames"),
    pytest.param([wire.encode(wire.TransferStatsRequest())[:-1] + b"\xff"], "bad_request", id="invalid-utf8"),
    pytest.param([b"\x82\xa4type\xaetransfer_stats\xa1x" + b"\x91" * 5000 + b"\x00"], "bad_request",
                 id="deeply-nested"),
    pytest.param([wire.encode(wire.TransferStatsRequest())[:-2]], "bad_request", id="truncated"),
    pytest.param([wire.encode(wire.AbortRequest(request_id="r"))], "bad_request", id="rpc-message"),
    pytest.param([wire.encode(wire.PullHeader(ok=True, num_layers=3))], "bad_request", id="reply-message"),
]


@pytest.mark.parametrize("frames, code", MALFORMED)
def test_malformed_frames_get_an_error_and_the_server_keeps_serving(producer, consumer, context, frames, code):
    reply = _exchange(context, producer.address, frames)
    assert isinstance(reply, wire.ErrorReply)
    assert reply.code == code
    assert reply.message
    # Still serving.
    _, source = producer.lease((5, 6))
    assert pull_into(context, consumer, source, [1], [2]) == consumer.spec.bytes_per_block
    assert_pulled(producer, consumer, [6], [2])


def test_server_survives_a_burst_of_garbage(producer, consumer, context):
    socket = secure_client(context.socket(zmq.DEALER), "worker", transfer=True)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(producer.address)
    try:
        for i in range(50):
            socket.send_multipart([bytes([i]) * (i + 1)] * (1 + i % 3))
        replies = []
        while len(replies) < 50 and socket.poll(5000):
            replies.append(wire.decode(socket.recv()))
    finally:
        socket.close(linger=0)
    assert len(replies) == 50
    assert all(isinstance(reply, wire.ErrorReply) for reply in replies)
    _, source = producer.lease((0, 11))
    pull_into(context, consumer, source, [0, 1], [8, 9])
    assert_pulled(producer, consumer, [0, 11], [8, 9])


# ---------------------------------------------------------------- staged leases


@pytest.mark.parametrize("positions", [[0, 1, 2, 3, 4], [1, 2, 3, 4], [0, 2, 4], [3, 1]],
                         ids=["whole", "contiguous", "gaps", "reversed"])
def test_staged_lease_is_served_from_its_copy(producer, consumer, context, positions):
    lease_blocks = (3, 7, 1, 10, 5)
    lease, source = producer.lease(lease_blocks, grant=False)
    producer.leases.grant(lease, staging_bytes=len(lease_blocks) * producer.cache.spec.bytes_per_block)
    original = stage(producer, lease)
    local_ids = [9, 0, 4, 6, 2][: len(positions)]

    assert pull_into(context, consumer, source, positions, local_ids) == len(positions) * consumer.spec.bytes_per_block

    for layer in range(NUM_LAYERS):
        for position, local_id in zip(positions, local_ids):
            expected = original[layer].select(producer.cache.block_dim, lease_blocks[position]).contiguous()
            assert torch.equal(block_bytes(consumer, layer, local_id), expected.view(torch.uint8))
    assert fetch_transfer_stats(context, producer.address).counters.leases_staged == 1
    assert release_lease(context, producer.address, lease.handle, "ack")
    assert producer.leases.staged_bytes == 0 and producer.leases.take_ended_request_ids() == set()


def test_pull_while_staging_waits_for_the_copy(producer, consumer, context):
    lease_blocks = (2, 8)
    lease, source = producer.lease(lease_blocks, grant=False)
    producer.leases.grant(lease, staging_bytes=2 * producer.cache.spec.bytes_per_block)
    copy = producer.cache.copy_blocks(block_index_tensor(lease_blocks))
    timer = threading.Timer(0.1, producer.leases.finish_staging, args=(lease.handle, copy))
    timer.start()
    try:
        started = time.monotonic()
        pull_into(context, consumer, source, [0, 1], [3, 5])
        assert time.monotonic() - started >= 0.09  # parked until the copy was done
    finally:
        timer.join()
    assert_pulled(producer, consumer, lease_blocks, [3, 5])
