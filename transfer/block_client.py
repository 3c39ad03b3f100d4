"""The pulling side of the transfer endpoint protocol (see ``block_server``).

Every call has a deadline: ZeroMQ never reports a dead peer, so without one a pull
from a crashed producer would wait forever.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence

import torch
import zmq

from kvroute import wire


class PullFailed(RuntimeError):
    """The producer refused, vanished, or answered with something unexpected."""


class _Channel:
    """One DEALER socket to one endpoint, used for one exchange and closed after."""

    def __init__(self, context: zmq.Context, address: str, deadline: float):
        self.deadline = deadline
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.address = address

    def send(self, message: wire._Message) -> None:
        self.socket.send(wire.encode(message))

    def receive_frame(self) -> zmq.Frame:
        remaining_ms = int((self.deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not self.socket.poll(remaining_ms):
            raise PullFailed(f"no answer from {self.address} before the deadline")
        return self.socket.recv(copy=False)

    def receive_message(self) -> wire.Message:
        return wire.decode(self.receive_frame().bytes)

    def close(self) -> None:
        self.socket.close(linger=0)


def frame_as_tensor(frame: zmq.Frame) -> torch.Tensor:
    """A uint8 view of a received frame, without copying it."""
    with warnings.catch_warnings():
        # The frame is read-only; we only ever read from this view.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(frame.buffer, dtype=torch.uint8)


LayerSink = Callable[[int, torch.Tensor], None]


def pull_blocks(context: zmq.Context, source: wire.PullSource, block_indices: Sequence[int],
                layout: wire.KVLayoutSpec, on_layer: LayerSink, deadline: float) -> int:
    """Pull the given lease positions; ``on_layer(layer, data)`` stores each layer.

    Returns the number of bytes received. Raises PullFailed on refusal, a short or
    missing frame, or the deadline.
    """
    channel = _Channel(context, source.address, deadline)
    try:
        header = _request_pull(channel, wire.PullBlocks(handle=source.handle, block_indices=list(block_indices),
                                                        layout=layout))
        expected = len(block_indices) * layout.bytes_per_block // layout.num_layers
        for layer in range(header.num_layers):
            frame = channel.receive_frame()
            if len(frame) != expected:
                raise PullFailed(f"layer {layer}: got {len(frame)} bytes, expected {expected}")
            on_layer(layer, frame_as_tensor(frame))
        return expected * header.num_layers
    except wire.WireError as error:
        raise PullFailed(str(error)) from error
    finally:
        channel.close()


def pull_exchange(context: zmq.Context, address: str, request: wire.PullOverLink, deadline: float) -> wire.PullHeader:
    """Ask for a pull whose layers travel elsewhere (``transfer.link_control``): only the
    header comes back here. Raises PullFailed on refusal or the deadline."""
    channel = _Channel(context, address, deadline)
    try:
        return _request_pull(channel, request)
    except wire.WireError as error:
        raise PullFailed(str(error)) from error
    finally:
        channel.close()


def _request_pull(channel: _Channel, request: wire.PullBlocks | wire.PullOverLink) -> wire.PullHeader:
    channel.send(request)
    header = channel.receive_message()
    if not isinstance(header, wire.PullHeader) or not header.ok:
        raise PullFailed(f"producer refused the pull: {getattr(header, 'error', header)}")
    return header


def release_lease(context: zmq.Context, address: str, handle: str, reason: str,
                  timeout: float = 2.0) -> bool:
    """Ask the producer to free a lease; False if it was unknown or did not answer."""
    channel = _Channel(context, address, time.monotonic() + timeout)
    try:
        channel.send(wire.ReleaseLease(handle=handle, reason=reason))
        reply = channel.receive_message()
        return isinstance(reply, wire.ReleaseReply) and reply.released
    except (PullFailed, wire.WireError):
        return False
    finally:
        channel.close()


def _request(context: zmq.Context, address: str, message: wire._Message, reply_type: type,
             timeout: float):
    """One request, one reply of ``reply_type``, within ``timeout`` seconds."""
    channel = _Channel(context, address, time.monotonic() + timeout)
    try:
        channel.send(message)
        reply = channel.receive_message()
        if not isinstance(reply, reply_type):
            raise PullFailed(f"unexpected reply {type(reply).__name__}")
        return reply
    finally:
        channel.close()


def release_all_leases(context: zmq.Context, address: str, reason: str = "reset", timeout: float = 2.0) -> int:
    """End every lease on one endpoint; returns how many were held."""
    return _request(context, address, wire.ReleaseAllLeases(reason=reason), wire.ReleaseReply, timeout).count


def fetch_pull_records(context: zmq.Context, address: str, request_id: str,
                       timeout: float = 2.0) -> list[wire.PullRecord]:
    request = wire.PullRecordsRequest(request_id=request_id)
    return _request(context, address, request, wire.PullRecordsReply, timeout).records


def fetch_transfer_stats(context: zmq.Context, address: str, timeout: float = 2.0) -> wire.TransferStatsReply:
    return _request(context, address, wire.TransferStatsRequest(), wire.TransferStatsReply, timeout)
