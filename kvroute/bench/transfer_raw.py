"""A raw pyzmq zero-copy baseline for the transfer endpoint, and a stand-in KV cache.

The baseline speaks the same shape of exchange as ``transfer.block_server``: a DEALER
asks a ROUTER for data, the ROUTER answers with one small header frame and then one
message per layer, sent with ``copy=False`` from buffers allocated (and touched)
before timing starts. Nothing is gathered on the sending side, nothing is scattered
on the receiving side unless the caller passes a sink: it is the transport alone.

The sender (``serve``) binds any ZeroMQ endpoint, tcp or ipc. It runs in its own
process (``RawSender``, ``multiprocessing`` spawn), optionally pinned to the same CPUs as
the engine's block-server thread so it competes for cores the way the real producer
does. (The transport links, PUSH to PULL, have their own baseline: ``transfer_raw_push``.)
"""

from __future__ import annotations

import multiprocessing
import os
import random
import secrets
import tempfile
import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import torch
import zmq

from foundation.wire import KVLayoutSpec
from transfer.transports.zmq_backend import remove_ipc_socket_file

_ZERO_COPY_MIN_BYTES = 64 * 1024  # same threshold as transfer.send_buffers


class _Command(msgspec.Struct):
    op: str  # "prepare" | "send" | "stop"
    frame_bytes: int = 0
    num_frames: int = 0


LOOPBACK_TCP = "tcp://127.0.0.1:*"


def ipc_bind_address(directory: str | None = None) -> str:
    """A fresh ipc endpoint for ``serve``, which removes the socket file when it returns."""
    name = f"kvroute-raw-{secrets.token_hex(8)}.sock"
    return f"ipc://{os.path.join(directory or tempfile.gettempdir(), name)}"


def serve(address_queue, cpus: Sequence[int] | None = None, bind_address: str = LOOPBACK_TCP) -> None:
    """The raw sender's main loop: answer prepare/send/stop on a ROUTER socket bound at
    ``bind_address`` (any ZeroMQ endpoint; ``*`` for a free tcp port). The endpoint actually
    bound goes to ``address_queue`` (anything with ``put``) before the first request.
    Runs in a process of its own (``RawSender``)."""
    if cpus:
        os.sched_setaffinity(0, set(cpus))  # before the context, so libzmq's I/O thread inherits it
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(bind_address)
    address_queue.put(socket.getsockopt_string(zmq.LAST_ENDPOINT))
    buffers: dict[tuple[int, int], list[np.ndarray]] = {}
    decoder = msgspec.msgpack.Decoder(_Command)
    try:
        while True:
            identity, frame = socket.recv_multipart()
            command = decoder.decode(frame)
            if command.op == "stop":
                socket.send_multipart([identity, b"bye"])
                return
            key = (command.frame_bytes, command.num_frames)
            if command.op == "prepare":
                if key not in buffers:
                    # np.full touches every page, as a live KV cache / reused send buffer is.
                    # One size is held at a time: a sweep's largest sizes are hundreds of MB.
                    buffers = {key: [np.full(command.frame_bytes, i % 251, dtype=np.uint8)
                                     for i in range(command.num_frames)]}
                socket.send_multipart([identity, b"ready"])
            elif command.op == "send":
                frames = buffers[key]
                socket.send_multipart([identity, b"ok"])
                for payload in frames:
                    socket.send_multipart([identity, memoryview(payload)],
                                          copy=payload.nbytes < _ZERO_COPY_MIN_BYTES)
    finally:
        socket.close(linger=0)
        context.term()
        remove_ipc_socket_file(bind_address)


class RawSender:
    """The sending process; ``stop()`` ends it (also called on context exit)."""

    def __init__(self, cpus: Sequence[int] | None = None, timeout: float = 60.0,
                 bind_address: str = LOOPBACK_TCP):
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        self.process = ctx.Process(target=serve, args=(queue, list(cpus) if cpus else None, bind_address),
                                   name="kvroute-raw-sender", daemon=True)
        self.process.start()
        self.address: str = queue.get(timeout=timeout)

    def stop(self) -> None:
        if self.process.is_alive():
            receiver = RawReceiver(self.address)
            try:
                receiver.stop_sender()
            finally:
                receiver.close()
            self.process.join(5)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)

    def __enter__(self) -> RawSender:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


LayerSink = Callable[[int, torch.Tensor], None]


class RawReceiver:
    """The pulling side of the baseline: time ``num_frames`` frames of ``frame_bytes``."""

    def __init__(self, address: str, context: zmq.Context | None = None):
        self.address = address
        self.context = context or zmq.Context.instance()
        self._socket: zmq.Socket | None = None

    def _connect(self) -> zmq.Socket:
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address)
        return socket

    def _persistent(self) -> zmq.Socket:
        if self._socket is None:
            self._socket = self._connect()
        return self._socket

    def prepare(self, frame_bytes: int, num_frames: int, timeout: float = 60.0) -> None:
        socket = self._persistent()
        socket.send(msgspec.msgpack.encode(_Command("prepare", frame_bytes, num_frames)))
        if not socket.poll(int(timeout * 1000)):
            raise TimeoutError("raw sender did not prepare its buffers")
        socket.recv()

    def transfer(self, frame_bytes: int, num_frames: int, sink: LayerSink | None = None,
                 fresh_socket: bool = False, timeout: float = 60.0) -> tuple[float, int]:
        """(seconds, bytes) for one request → header → ``num_frames`` frames exchange.

        With ``fresh_socket`` a new DEALER is connected for this transfer and closed after
        (what ``transfer.block_client.pull_blocks`` does); the connect is inside the timing.
        """
        start = time.perf_counter()
        socket = self._connect() if fresh_socket else self._persistent()
        try:
            socket.send(msgspec.msgpack.encode(_Command("send", frame_bytes, num_frames)))
            received = 0
            for index in range(num_frames + 1):
                if not socket.poll(int(timeout * 1000)):
                    raise TimeoutError("raw sender stopped answering")
                frame = socket.recv(copy=False)
                if index == 0:
                    continue  # header
                if len(frame) != frame_bytes:
                    raise RuntimeError(f"frame {index}: {len(frame)} bytes, expected {frame_bytes}")
                received += len(frame)
                if sink is not None:
                    sink(index - 1, torch.frombuffer(frame.buffer, dtype=torch.uint8))
            return time.perf_counter() - start, received
        finally:
            if fresh_socket:
                socket.close(linger=0)

    def stop_sender(self, timeout: float = 2.0) -> None:
        """Ask the sender (``serve``) to return, closing its socket (and ipc file)."""
        socket = self._persistent()
        socket.send(msgspec.msgpack.encode(_Command("stop")))
        socket.poll(int(timeout * 1000))

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None


def fake_cache_layers(layout: KVLayoutSpec, min_blocks: int) -> tuple[list[torch.Tensor], int]:
    """Zeroed (page-touched) per-layer tensors shaped like the engine's, with at least
    ``min_blocks`` blocks; the block count is chosen so the block dimension is unambiguous."""
    num_blocks = max(min_blocks, 1)
    while num_blocks in layout.block_shape:
        num_blocks += 1
    shape = list(layout.block_shape)
    shape.insert(layout.block_dim, num_blocks)
    dtype = getattr(torch, layout.dtype)
    return [torch.zeros(shape, dtype=dtype) for _ in range(layout.num_layers)], num_blocks


def destination_blocks(num_blocks_in_cache: int, count: int, seed: int = 0) -> list[int]:
    """Scattered destination block ids, as a consumer's allocator would hand out."""
    return random.Random(seed).sample(range(num_blocks_in_cache), count)
