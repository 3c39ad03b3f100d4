"""The pulling side of the transfer endpoint protocol (see ``block_server``).

Every call has a deadline: ZeroMQ never reports a dead peer, so without one a pull
from a crashed producer would wait forever.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence

import msgspec
import torch
import zmq

from kvroute import wire
from transfer.shared_copies import SharedCopyUnavailable, local_host

logger = logging.getLogger("kvroute.transfer.client")


class PullFailed(RuntimeError):
    """The producer refused, vanished, or answered with something unexpected."""


class _Channel:
    """One DEALER socket to one endpoint, for one exchange at a time."""

    def __init__(self, context: zmq.Context, address: str, deadline: float, socket: zmq.Socket | None = None):
        self.deadline = deadline
        if socket is None:
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
        self.socket = socket
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


class ChannelPool:
    """Connected sockets by endpoint, reused from one exchange to the next.

    A fresh socket per pull pays a TCP handshake and a ZMTP greeting each time (1-2 ms,
    a fifth of an 11 MB pull on loopback). A channel goes back to the pool only after a
    complete exchange: one that failed or timed out may still have frames of the
    abandoned exchange on the way, so it is closed, never reused. Safe across threads;
    a channel is used by one thread at a time."""

    def __init__(self, context: zmq.Context, idle_per_address: int = 2):
        self.context = context
        self.idle_per_address = idle_per_address
        self._idle: dict[str, list[zmq.Socket]] = {}
        self._lock = threading.Lock()
        self._closed = False

    @contextlib.contextmanager
    def channel(self, address: str, deadline: float) -> Iterator[_Channel]:
        with self._lock:
            idle = self._idle.get(address)
            socket = idle.pop() if idle else None
        channel = _Channel(self.context, address, deadline, socket)
        try:
            yield channel
        except BaseException:
            channel.close()
            raise
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if self._closed or len(idle) >= self.idle_per_address:
                channel.close()
            else:
                idle.append(channel.socket)

    def idle_channels(self, address: str) -> int:
        with self._lock:
            return len(self._idle.get(address, ()))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = [socket for idle in self._idle.values() for socket in idle]
            self._idle.clear()
        for socket in sockets:
            socket.close(linger=0)


@contextlib.contextmanager
def _exchange(context: zmq.Context, address: str, deadline: float,
              channels: ChannelPool | None) -> Iterator[_Channel]:
    """A pooled channel when ``channels`` is given, else one opened and closed here."""
    if channels is not None:
        with channels.channel(address, deadline) as channel:
            yield channel
        return
    channel = _Channel(context, address, deadline)
    try:
        yield channel
    finally:
        channel.close()


# Some pyzmq versions hand out received frames read-only, which torch warns about; the views
# of frame_as_tensor are only ever read. (A filter once, not catch_warnings per frame: that
# is not thread-safe, and costs more than the view itself.)
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def frame_as_tensor(frame: zmq.Frame) -> torch.Tensor:
    """A uint8 view of a received frame, without copying it."""
    return torch.frombuffer(frame.buffer, dtype=torch.uint8)


LayerSink = Callable[[int, torch.Tensor], None]
# Reads every requested block from a producer's shared copy into the cache; returns the
# bytes read or raises SharedCopyUnavailable (see transfer.shared_copies.read_shared_copy).
SharedCopyReader = Callable[[wire.SharedCopyRef], int]


def pull_blocks(context: zmq.Context, source: wire.PullSource, block_indices: Sequence[int],
                layout: wire.KVLayoutSpec, on_layer: LayerSink, deadline: float,
                channels: ChannelPool | None = None, read_shared: SharedCopyReader | None = None) -> int:
    """Pull the given lease positions; ``on_layer(layer, data)`` stores each layer.

    With ``read_shared``, a producer on this host may offer the lease's copy in shared
    memory instead, which ``read_shared`` reads; when it cannot, the layers are asked for
    again as frames on the same connection.

    Returns the number of bytes received. Raises PullFailed on refusal, a short or
    missing frame, or the deadline.
    """
    request = wire.PullBlocks(handle=source.handle, block_indices=list(block_indices), layout=layout,
                              host=local_host() if read_shared is not None else "")
    try:
        with _exchange(context, source.address, deadline, channels) as channel:
            header = _request_pull(channel, request)
            if header.shared_copy is not None:
                try:
                    return read_shared(header.shared_copy)
                except SharedCopyUnavailable as error:
                    logger.warning("reading the shared copy of %s failed (%s); pulling its layers as frames",
                                   source.address, error)
                    header = _request_pull(channel, msgspec.structs.replace(request, host=""))
            expected = len(block_indices) * layout.bytes_per_block // layout.num_layers
            for layer in range(header.num_layers):
                frame = channel.receive_frame()
                if len(frame) != expected:
                    raise PullFailed(f"layer {layer}: got {len(frame)} bytes, expected {expected}")
                on_layer(layer, frame_as_tensor(frame))
            return expected * header.num_layers
    except wire.WireError as error:
        raise PullFailed(str(error)) from error


def pull_exchange(context: zmq.Context, address: str, request: wire.PullOverLink, deadline: float,
                  channels: ChannelPool | None = None) -> wire.PullHeader:
    """Ask for a pull whose layers travel elsewhere (``transfer.link_control``): only the
    header comes back here. Raises PullFailed on refusal or the deadline."""
    try:
        with _exchange(context, address, deadline, channels) as channel:
            return _request_pull(channel, request)
    except wire.WireError as error:
        raise PullFailed(str(error)) from error


def _request_pull(channel: _Channel, request: wire.PullBlocks | wire.PullOverLink) -> wire.PullHeader:
    channel.send(request)
    header = channel.receive_message()
    if not isinstance(header, wire.PullHeader) or not header.ok:
        raise PullFailed(f"producer refused the pull: {getattr(header, 'error', header)}")
    return header


def release_lease(context: zmq.Context, address: str, handle: str, reason: str,
                  timeout: float = 2.0, channels: ChannelPool | None = None) -> bool:
    """Ask the producer to free a lease; False if it was unknown or did not answer."""
    try:
        with _exchange(context, address, time.monotonic() + timeout, channels) as channel:
            channel.send(wire.ReleaseLease(handle=handle, reason=reason))
            reply = channel.receive_message()
            return isinstance(reply, wire.ReleaseReply) and reply.released
    except (PullFailed, wire.WireError):
        return False


def _request(context: zmq.Context, address: str, message: wire._Message, reply_type: type,
             timeout: float):
    """One request, one reply of ``reply_type``, within ``timeout`` seconds."""
    with _exchange(context, address, time.monotonic() + timeout, None) as channel:
        channel.send(message)
        reply = channel.receive_message()
        if not isinstance(reply, reply_type):
            raise PullFailed(f"unexpected reply {type(reply).__name__}")
        return reply


def release_all_leases(context: zmq.Context, address: str, reason: str = "reset", timeout: float = 2.0) -> int:
    """End every lease on one endpoint; returns how many were held."""
    return _request(context, address, wire.ReleaseAllLeases(reason=reason), wire.ReleaseReply, timeout).count


def fetch_pull_records(context: zmq.Context, address: str, request_id: str,
                       timeout: float = 2.0) -> list[wire.PullRecord]:
    request = wire.PullRecordsRequest(request_id=request_id)
    return _request(context, address, request, wire.PullRecordsReply, timeout).records


def fetch_transfer_stats(context: zmq.Context, address: str, timeout: float = 2.0) -> wire.TransferStatsReply:
    return _request(context, address, wire.TransferStatsRequest(), wire.TransferStatsReply, timeout)
