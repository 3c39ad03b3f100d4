"""Contract suite of the transports (``transfer.transports``), run against every backend.

Blocks are gathered from a paged source cache into per-layer frames, moved over a link,
and scattered into a paged destination cache, exactly as the connector moves KV. Both
ends run as threads of this process (the fake backend only works that way), except in
the dead-peer test, where the sender is a spawned process that is killed mid-link.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from foundation.wire import KVLayoutSpec
from transfer.kv_layout import LayoutMismatch, PagedKVCache, block_index_tensor
from transfer.transports.control import ConnectionChannel
from transfer.transports.errors import FrameMismatch, LinkClosed, TransportError, TransportTimeout
from transfer.transports.links import open_receiver, open_sender
from transfer.transports.nixl_agent import nixl_missing
from transfer.transports.settings import TransportSettings

pytestmark = pytest.mark.timeout(60)

NUM_LAYERS = 3
SOURCE_BLOCKS = 12
DESTINATION_BLOCKS = 14  # caches of different sizes still exchange blocks
DEADLINE_SECONDS = 10.0
SHORT_DEADLINE_SECONDS = 0.8  # for the tests that must fail: they may take this long, and no longer
SLACK_SECONDS = 1.5

_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                               reason="NCCL needs two CUDA devices (one per end)")
_nixl = pytest.mark.skipif(bool(nixl_missing()), reason="nixl_cu12 is not installed")
BACKENDS = ["fake", "zmq-tcp", "zmq-ipc", "gloo", pytest.param("nccl", marks=_two_gpus),
            pytest.param("nixl", marks=_nixl)]
DEVICES = {"nccl": ("cuda:0", "cuda:1")}  # (sender, receiver); every other backend: host memory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.int8, "uint8": torch.uint8}
SHAPES = {
    # block dimension first (vLLM's CPU backend), frames above the zero-copy threshold
    "blocks-first-h4-b16-d32": lambda n: (n, 2, 4, 16, 32),
    # K/V first (FlashAttention), smaller heads and longer head size
    "kv-first-h2-b8-d64": lambda n: (2, n, 2, 8, 64),
}


def devices(backend: str) -> tuple[str, str]:
    return DEVICES.get(backend, ("cpu", "cpu"))


def make_cache(dtype: torch.dtype, shape: str, num_blocks: int, seed: int, device: str = "cpu") -> PagedKVCache:
    """Random bytes in every layer (NaN patterns included, for float types)."""
    full_shape = SHAPES[shape](num_blocks)
    generator = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers = [torch.randint(0, 256, (*full_shape[:-1], full_shape[-1] * itemsize), dtype=torch.uint8,
                            generator=generator).view(dtype).to(device) for _ in range(NUM_LAYERS)]
    return PagedKVCache(layers, num_blocks, block_size=full_shape[3])


def block_bytes(cache: PagedKVCache, layer: int, block_id: int) -> torch.Tensor:
    return cache.layers[layer].select(cache.block_dim, block_id).contiguous().view(torch.uint8).cpu()


def snapshot(cache: PagedKVCache) -> list[list[torch.Tensor]]:
    return [[block_bytes(cache, layer, block) for block in range(cache.num_blocks)]
            for layer in range(len(cache.layers))]


def deadline(seconds: float = DEADLINE_SECONDS) -> float:
    return time.monotonic() + seconds


# ---------------------------------------------------------------- running both ends


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None

    def get(self):
        if self.error is not None:
            raise self.error
        return self.value


def run(call: Callable[[], Any]) -> Outcome:
    try:
        return Outcome(value=call())
    except BaseException as error:  # noqa: BLE001 - handed to the test to assert on
        return Outcome(error=error)


def both(sender_call: Callable[[], Any], receiver_call: Callable[[], Any],
         join_seconds: float = DEADLINE_SECONDS + SLACK_SECONDS) -> tuple[Outcome, Outcome]:
    """The sender's call on a thread, the receiver's here; neither may outlive ``join_seconds``."""
    sender_outcome: list[Outcome] = []
    thread = threading.Thread(target=lambda: sender_outcome.append(run(sender_call)), daemon=True)
    thread.start()
    receiver_outcome = run(receiver_call)
    thread.join(join_seconds)
    assert not thread.is_alive(), "the sending end hung past its deadline"
    return sender_outcome[0], receiver_outcome


class Links:
    """Opens links for one test and closes them all at the end."""

    def __init__(self, backend: str):
        self.backend = backend
        self.ends: list = []

    def open_outcomes(self, sender_layout: KVLayoutSpec, receiver_layout: KVLayoutSpec,
                      seconds: float = DEADLINE_SECONDS) -> tuple[Outcome, Outcome]:
        sender_pipe, receiver_pipe = multiprocessing.Pipe()
        settings = TransportSettings(backend=self.backend)
        sender_device, receiver_device = devices(self.backend)
        end_by = deadline(seconds)
        outcomes = both(
            lambda: open_sender(ConnectionChannel(sender_pipe), sender_layout, sender_device, end_by, settings),
            lambda: open_receiver(ConnectionChannel(receiver_pipe), receiver_layout, receiver_device, end_by,
                                  settings))
        self.ends += [outcome.value for outcome in outcomes if outcome.value is not None]
        return outcomes

    def open(self, layout: KVLayoutSpec):
        sender, receiver = self.open_outcomes(layout, layout)
        return sender.get(), receiver.get()

    def close(self) -> None:
        for end in self.ends:
            end.close()


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def links(backend):
    opened = Links(backend)
    yield opened
    opened.close()


def frames_for(cache: PagedKVCache, num_blocks: int) -> list[int]:
    return [num_blocks * cache.layer_bytes_per_block] * len(cache.layers)


def move_blocks(sender, receiver, source: PagedKVCache, source_ids, destination: PagedKVCache,
                destination_ids, transfer_id: int = 1) -> tuple[int, list[int]]:
    """Gather -> send -> receive -> scatter; returns (bytes received, each frame's size)."""
    source_index = block_index_tensor(source_ids).to(source.layers[0].device)
    destination_index = block_index_tensor(destination_ids).to(destination.layers[0].device)
    frame_bytes = frames_for(source, len(source_ids))
    frame_sizes: list[int] = []

    def store(layer: int, data: torch.Tensor) -> None:
        frame_sizes.append(data.numel())
        destination.scatter_layer(layer, destination_index, data)

    sent, received = both(
        lambda: sender.send(frame_bytes, lambda layer, out: source.gather_layer(layer, source_index, out),
                            deadline(), transfer_id),
        lambda: receiver.receive(frame_bytes, store, deadline(), transfer_id))
    assert sent.get() == received.get()
    return received.get(), frame_sizes


def assert_moved(source: PagedKVCache, destination: PagedKVCache, before: list[list[torch.Tensor]],
                 moves: dict[int, int]) -> None:
    """Destination block d holds source block moves[d]; every other block is as it was."""
    for layer in range(NUM_LAYERS):
        for block in range(destination.num_blocks):
            expected = block_bytes(source, layer, moves[block]) if block in moves else before[layer][block]
            assert torch.equal(block_bytes(destination, layer, block), expected), (layer, block)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_random_blocks_round_trip_bit_exactly(links, backend, dtype_name, shape):
    sender_device, receiver_device = devices(backend)
    source = make_cache(DTYPES[dtype_name], shape, SOURCE_BLOCKS, seed=11, device=sender_device)
    destination = make_cache(DTYPES[dtype_name], shape, DESTINATION_BLOCKS, seed=22, device=receiver_device)
    before = snapshot(destination)
    sender, receiver = links.open(source.spec)
    assert sender.backend == receiver.backend == backend

    source_ids = [5, 0, 11, 3, 8, 1, 10, 2, 7, 4, 9, 6]  # every block, out of order
    destination_ids = [13, 2, 6, 0, 9, 4, 11, 1, 7, 12, 3, 10]  # scattered; 5 and 8 stay as they were
    nbytes, _ = move_blocks(sender, receiver, source, source_ids, destination, destination_ids)

    assert nbytes == len(source_ids) * source.spec.bytes_per_block
    assert_moved(source, destination, before, dict(zip(destination_ids, source_ids)))


def test_delta_transfers_move_only_the_requested_blocks(links, backend):
    sender_device, receiver_device = devices(backend)
    source = make_cache(torch.bfloat16, "blocks-first-h4-b16-d32", SOURCE_BLOCKS, seed=3, device=sender_device)
    destination = make_cache(torch.bfloat16, "blocks-first-h4-b16-d32", DESTINATION_BLOCKS, seed=4,
                             device=receiver_device)
    before = snapshot(destination)
    sender, receiver = links.open(source.spec)
    moves: dict[int, int] = {}

    # The destination already holds the prefix's first blocks; only the rest moves, in two
    # transfers over the same link (a second turn of the conversation).
    for transfer_id, (source_ids, destination_ids) in enumerate([([4, 9, 2], [7, 1, 12]), ([6], [3])], start=1):
        nbytes, frame_sizes = move_blocks(sender, receiver, source, source_ids, destination, destination_ids,
                                          transfer_id)
        assert nbytes == len(source_ids) * source.spec.bytes_per_block
        assert frame_sizes == [len(source_ids) * source.layer_bytes_per_block] * NUM_LAYERS
        moves.update(zip(destination_ids, source_ids))
        assert_moved(source, destination, before, moves)


def test_frames_lent_as_they_lie_arrive_bit_exactly_and_only_the_others_are_filled(links, backend):
    """A staged lease's contiguous runs go out without a copy into send buffers (``frame_view``);
    a frame without a view (None) is filled as usual, and so is a view on another device."""
    sender_device, _ = devices(backend)
    layout = make_cache(torch.float16, "kv-first-h2-b8-d64", SOURCE_BLOCKS, seed=7).spec
    sender, receiver = links.open(layout)
    nbytes = (3 << 20) // 2  # above the packing size: each frame travels alone
    generator = torch.Generator().manual_seed(8)
    frames = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator).to(sender_device)
              for _ in range(3)]
    filled, received = [], {}

    def fill(index: int, out: torch.Tensor) -> None:
        filled.append(index)
        out.copy_(frames[index])

    sent, got = both(
        lambda: sender.send([nbytes] * 3, fill, deadline(), 4, frame_view=lambda i: None if i == 1 else frames[i]),
        lambda: receiver.receive([nbytes] * 3, lambda i, data: received.__setitem__(i, data.cpu().clone()),
                                 deadline(), 4))
    assert sent.get() == got.get() == 3 * nbytes
    assert filled == [1]
    assert all(torch.equal(received[i], frames[i].cpu()) for i in range(3))


def test_empty_transfer_is_a_header_only(links):
    layout = make_cache(torch.float16, "kv-first-h2-b8-d64", SOURCE_BLOCKS, seed=5).spec
    sender, receiver = links.open(layout)
    sent, received = both(lambda: sender.send([], lambda *_: None, deadline(), 9),
                          lambda: receiver.receive([], lambda *_: None, deadline(), 9))
    assert sent.get() == received.get() == 0


# ---------------------------------------------------------------- refusals


def _changed(layout: KVLayoutSpec, **fields) -> KVLayoutSpec:
    values = {name: getattr(layout, name) for name in layout.__struct_fields__}
    return KVLayoutSpec(**{**values, **fields})


MISMATCHES = {
    "dtype": lambda spec: _changed(spec, dtype="float16"),
    "heads": lambda spec: _changed(spec, block_shape=[2, 8, 16, 32], bytes_per_block=spec.bytes_per_block * 2),
    "num_layers": lambda spec: _changed(spec, num_layers=spec.num_layers + 1),
    "block_size": lambda spec: _changed(spec, block_size=32),
}
MISMATCH_FIELDS = {"dtype": {"dtype"}, "heads": {"block_shape", "bytes_per_block"},
                   "num_layers": {"num_layers"}, "block_size": {"block_size"}}


@pytest.mark.parametrize("mismatch", list(MISMATCHES))
def test_layout_mismatch_is_refused_on_both_ends_naming_the_fields(links, mismatch):
    layout = make_cache(torch.bfloat16, "blocks-first-h4-b16-d32", SOURCE_BLOCKS, seed=6).spec
    sender, receiver = links.open_outcomes(layout, MISMATCHES[mismatch](layout))
    for outcome in (sender, receiver):
        assert isinstance(outcome.error, LayoutMismatch), outcome
        named = {part.split(":")[0].strip() for part in str(outcome.error).split(":", 1)[1].split(";")}
        assert named == MISMATCH_FIELDS[mismatch], str(outcome.error)


def test_an_unexpected_transfer_is_refused_and_closes_the_link(links):
    """The receiver checks the announced sizes before it takes any payload."""
    layout = make_cache(torch.float32, "blocks-first-h4-b16-d32", SOURCE_BLOCKS, seed=7).spec
    sender, receiver = links.open(layout)
    received: list[int] = []
    sent, refused = both(
        lambda: sender.send([4096, 8192], lambda _, out: out.fill_(1), deadline(SHORT_DEADLINE_SECONDS), 3),
        lambda: receiver.receive([4096, 4096], lambda index, _: received.append(index), deadline(), 3))
    assert isinstance(refused.error, FrameMismatch) and "total bytes" in str(refused.error)
    assert received == []
    assert sent.error is None or isinstance(sent.error, TransportError)
    with pytest.raises(LinkClosed):
        receiver.receive([4096], lambda *_: None, deadline(), 4)


def test_a_transfer_id_the_receiver_did_not_expect_is_refused(links):
    layout = make_cache(torch.float32, "blocks-first-h4-b16-d32", SOURCE_BLOCKS, seed=8).spec
    sender, receiver = links.open(layout)
    _, refused = both(lambda: sender.send([1024], lambda _, out: out.zero_(), deadline(SHORT_DEADLINE_SECONDS), 5),
                      lambda: receiver.receive([1024], lambda *_: None, deadline(), 6))
    assert isinstance(refused.error, FrameMismatch) and "transfer id 5, expected 6" in str(refused.error)


# ---------------------------------------------------------------- dead peers


def test_first_contact_with_a_silent_peer_times_out(backend):
    layout = make_cache(torch.uint8, "kv-first-h2-b8-d64", SOURCE_BLOCKS, seed=9).spec
    local, _peer_that_never_answers = multiprocessing.Pipe()
    started = time.monotonic()
    with pytest.raises(TransportTimeout):
        open_receiver(ConnectionChannel(local), layout, devices(backend)[1], deadline(SHORT_DEADLINE_SECONDS),
                      TransportSettings(backend=backend))
    assert time.monotonic() - started < SHORT_DEADLINE_SECONDS + SLACK_SECONDS


def test_a_sender_that_stops_sending_times_the_receiver_out(links):
    layout = make_cache(torch.int8, "kv-first-h2-b8-d64", SOURCE_BLOCKS, seed=10).spec
    _, receiver = links.open(layout)
    started = time.monotonic()
    with pytest.raises(TransportTimeout):
        receiver.receive([2048] * NUM_LAYERS, lambda *_: None, deadline(SHORT_DEADLINE_SECONDS), 1)
    assert time.monotonic() - started < SHORT_DEADLINE_SECONDS + SLACK_SECONDS
    assert receiver.closed


def test_sending_to_a_closed_receiver_never_hangs(links):
    """ZeroMQ cannot tell a dead receiver from a slow one, so the send may also look done;
    what every backend guarantees is an answer by the deadline."""
    layout = make_cache(torch.int8, "kv-first-h2-b8-d64", SOURCE_BLOCKS, seed=12).spec
    sender, receiver = links.open(layout)
    receiver.close()
    started = time.monotonic()
    outcome = run(lambda: sender.send([1 << 20] * 8, lambda _, out: out.fill_(2), deadline(SHORT_DEADLINE_SECONDS), 1))
    assert outcome.error is None or isinstance(outcome.error, TransportError), outcome.error
    assert time.monotonic() - started < SHORT_DEADLINE_SECONDS + SLACK_SECONDS


DEAD_PEER_SHAPE, DEAD_PEER_DTYPE, DEAD_PEER_SEED = "blocks-first-h4-b16-d32", torch.bfloat16, 31
KILLABLE_BACKENDS = ["zmq-tcp", "zmq-ipc", "gloo", *([] if nixl_missing() else ["nixl"])]


def _sender_process(backend: str, connection, ready) -> None:
    """A spawned producer: one transfer of its whole cache, then it waits to be killed."""
    from foundation import zmq_auth
    zmq_auth.configure_from_environment("worker")
    source = make_cache(DEAD_PEER_DTYPE, DEAD_PEER_SHAPE, SOURCE_BLOCKS, seed=DEAD_PEER_SEED)
    # Generous: the test that joins this sender may run well after the process started.
    sender = open_sender(ConnectionChannel(connection), source.spec, "cpu", deadline(120),
                         TransportSettings(backend=backend))
    index = block_index_tensor(range(SOURCE_BLOCKS))
    sender.send(frames_for(source, SOURCE_BLOCKS), lambda layer, out: source.gather_layer(layer, index, out),
                deadline(30), 1)
    ready.set()
    time.sleep(120)


@pytest.fixture(scope="module")
def killable_senders():
    """One spawned sender per backend, started together so their start-ups (imports, mostly)
    overlap; each test kills its own."""
    spawn = multiprocessing.get_context("spawn")
    senders = {}
    for backend in KILLABLE_BACKENDS:
        local, remote = spawn.Pipe()
        ready = spawn.Event()
        process = spawn.Process(target=_sender_process, args=(backend, remote, ready), daemon=True)
        process.start()
        senders[backend] = (process, local, ready)
    yield senders
    for process, _, _ in senders.values():
        if process.is_alive():
            process.kill()
        process.join(5)


@pytest.mark.parametrize("backend", KILLABLE_BACKENDS)
def test_a_killed_sender_process_fails_the_receiver_within_the_deadline(killable_senders, backend):
    process, local, ready = killable_senders[backend]
    source = make_cache(DEAD_PEER_DTYPE, DEAD_PEER_SHAPE, SOURCE_BLOCKS, seed=DEAD_PEER_SEED)
    destination = make_cache(DEAD_PEER_DTYPE, DEAD_PEER_SHAPE, DESTINATION_BLOCKS, seed=32)
    before = snapshot(destination)
    receiver = open_receiver(ConnectionChannel(local), source.spec, "cpu", deadline(40),
                             TransportSettings(backend=backend))
    destination_ids = list(range(1, SOURCE_BLOCKS + 1))
    index = block_index_tensor(destination_ids)
    receiver.receive(frames_for(source, SOURCE_BLOCKS),
                     lambda layer, data: destination.scatter_layer(layer, index, data), deadline(), 1)
    assert_moved(source, destination, before, dict(zip(destination_ids, range(SOURCE_BLOCKS))))
    assert ready.wait(10)

    os.kill(process.pid, signal.SIGKILL)
    process.join(5)
    started = time.monotonic()
    with pytest.raises(TransportError) as failure:
        receiver.receive(frames_for(source, 2), lambda *_: None, deadline(SHORT_DEADLINE_SECONDS * 2), 2)
    assert time.monotonic() - started < SHORT_DEADLINE_SECONDS * 2 + SLACK_SECONDS
    assert str(failure.value)
    assert receiver.closed


# ---------------------------------------------------------------- checksums


MIXED_FRAMES = [4096, 300_000, 2 << 20, 4096]  # packed small frames, and one that travels alone


def _random_frames(sizes: list[int], device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(12)
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator).to(device) for nbytes in sizes]


def test_checksummed_transfers_arrive_bit_exactly(links, backend):
    sender_device, _ = devices(backend)
    sender, receiver = links.open(make_cache(torch.float16, "kv-first-h2-b8-d64", SOURCE_BLOCKS, seed=9).spec)
    frames = _random_frames(MIXED_FRAMES, sender_device)
    received: dict[int, torch.Tensor] = {}
    sent, got = both(
        lambda: sender.send(MIXED_FRAMES, lambda i, out: out.copy_(frames[i]), deadline(), 2,
                            frame_view=lambda i: frames[i] if i == 2 else None, checksummed=True),
        lambda: receiver.receive(MIXED_FRAMES, lambda i, data: received.__setitem__(i, data.cpu().clone()),
                                 deadline(), 2, checksummed=True))
    assert sent.get() == got.get() == sum(MIXED_FRAMES)
    assert all(torch.equal(received[i], frames[i].cpu()) for i in range(len(frames)))


def test_a_frame_that_fails_its_checksum_is_refused_before_it_is_stored(links, backend, monkeypatch):
    """The sender's digest of frame 1 is not its bytes' (a frame changed on the way): the
    receiver stores frame 0, refuses frame 1, and the link is closed."""
    from transfer.transports import base
    from transfer.transports.checksums import ChecksumMismatch

    real_digest, digests_made = base.frame_digest, []

    def digest_with_a_fault(data):
        digests_made.append(1)
        return real_digest(data) if len(digests_made) != 2 else bytes(8)

    monkeypatch.setattr(base, "frame_digest", digest_with_a_fault)
    sender_device, _ = devices(backend)
    sender, receiver = links.open(make_cache(torch.float16, "kv-first-h2-b8-d64", SOURCE_BLOCKS, seed=9).spec)
    frames = _random_frames(MIXED_FRAMES, sender_device)
    stored: list[int] = []
    sent, refused = both(
        lambda: sender.send(MIXED_FRAMES, lambda i, out: out.copy_(frames[i]), deadline(SHORT_DEADLINE_SECONDS),
                            3, checksummed=True),
        lambda: receiver.receive(MIXED_FRAMES, lambda i, _: stored.append(i), deadline(), 3, checksummed=True))
    assert isinstance(refused.error, ChecksumMismatch) and "frame 1" in str(refused.error)
    assert stored == [0]
    assert sent.error is None or isinstance(sent.error, TransportError)
    assert receiver.closed


def test_a_receiver_expecting_checksums_refuses_a_transfer_without_them(links):
    sender, receiver = links.open(make_cache(torch.float32, "blocks-first-h4-b16-d32", SOURCE_BLOCKS, seed=7).spec)
    _, refused = both(lambda: sender.send([1024], lambda _, out: out.zero_(), deadline(SHORT_DEADLINE_SECONDS), 5),
                      lambda: receiver.receive([1024], lambda *_: None, deadline(), 5, checksummed=True))
    assert isinstance(refused.error, FrameMismatch) and "checksums 0, expected 1" in str(refused.error)
