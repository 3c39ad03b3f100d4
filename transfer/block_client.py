"""The pulling side of the transfer endpoint protocol (see ``block_server``).

Every call has a deadline: ZeroMQ never reports a dead peer, so without one a pull
from a crashed producer would wait forever.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence

import msgspec
import torch
import zmq

from foundation import wire
from foundation.endpoint_client import Channel, ChannelPool, PullFailed, exchange
from transfer.pull_check import CorruptFrame, check_pull_header
from transfer.shared_copies import SharedCopyUnavailable, local_host
from transfer.transports.checksums import ChecksumMismatch, check_frame

logger = logging.getLogger("kvroute.transfer.client")


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
# READs the requested blocks of a producer's staged copy into the cache with NIXL; returns the
# bytes read or raises PullFailed (see transfer.direct_reads.DirectReader.read).
DirectReader = Callable[[wire.DirectRef], int]


def pull_blocks(context: zmq.Context, source: wire.PullSource, block_indices: Sequence[int],
                layout: wire.KVLayoutSpec, on_layer: LayerSink, deadline: float,
                channels: ChannelPool | None = None, read_shared: SharedCopyReader | None = None,
                checksum: bool = False, read_direct: DirectReader | None = None) -> int:
    """Pull the given lease positions; ``on_layer(layer, data)`` stores each layer.

    With ``read_direct``, a producer holding the lease staged may offer its copy for a NIXL
    READ instead; once ``read_direct`` has read it, the producer must confirm the lease was
    live throughout (``ConfirmRead``), else the pull fails.
    With ``read_shared``, a producer on this host may offer the lease's copy in shared
    memory instead, which ``read_shared`` reads; when it cannot, the layers are asked for
    again as frames on the same connection. A pinned copy (in the producer's staging arena)
    must be confirmed after reading, as a direct READ is. With ``checksum``, every frame comes after
    its digest and is checked before ``on_layer`` sees it.

    Returns the number of bytes received. Raises PullFailed on refusal, a short or
    missing frame, or the deadline; PullRefused (nothing stored) when the producer's
    header disagrees with the pull, CorruptFrame when a frame fails its checksum.
    """
    request = wire.PullBlocks(handle=source.handle, block_indices=list(block_indices), layout=layout,
                              host=local_host() if read_shared is not None else "", checksum=checksum,
                              direct=read_direct is not None, confirms_shared=read_shared is not None)
    try:
        with exchange(context, source.address, deadline, channels) as channel:
            header = _request_pull(channel, request)
            if header.direct is not None:
                nbytes = read_direct(header.direct)
                _confirm_read(channel, source.handle, header.direct.pin)
                return nbytes
            if header.shared_copy is not None:
                try:
                    nbytes = read_shared(header.shared_copy)
                    if header.shared_copy.pin:
                        _confirm_read(channel, source.handle, header.shared_copy.pin)
                    return nbytes
                except SharedCopyUnavailable as error:
                    logger.warning("reading the shared copy of %s failed (%s); pulling its layers as frames",
                                   source.address, error)
                    header = _request_pull(channel, msgspec.structs.replace(request, host=""))
            for layer in range(header.num_layers):
                digest = channel.receive_frame().bytes if checksum else None
                frame = channel.receive_frame()
                if len(frame) != header.frame_bytes:
                    raise PullFailed(f"layer {layer}: got {len(frame)} bytes, expected {header.frame_bytes}")
                if digest is not None:
                    _check_digest(layer, frame, digest)
                on_layer(layer, frame_as_tensor(frame))
            return header.frame_bytes * header.num_layers
    except wire.WireError as error:
        raise PullFailed(str(error)) from error


def _confirm_read(channel: Channel, handle: str, pin: int) -> None:
    """Raise PullFailed unless the producer vouches that the read saw the lease live."""
    channel.send(wire.ConfirmRead(handle=handle, pin=pin))
    reply = channel.receive_message()
    if not isinstance(reply, wire.ConfirmReadReply) or not reply.valid:
        raise PullFailed(f"the producer did not confirm the read: {getattr(reply, 'error', reply)}")


def _check_digest(layer: int, frame: zmq.Frame, digest: bytes) -> None:
    try:
        check_frame(layer, frame.buffer, digest)
    except ChecksumMismatch as error:
        raise CorruptFrame(str(error)) from error


def pull_exchange(context: zmq.Context, address: str, request: wire.PullOverLink, deadline: float,
                  channels: ChannelPool | None = None) -> wire.PullHeader:
    """Ask for a pull whose layers travel elsewhere (``transfer.link_control``): only the
    header comes back here. Raises PullFailed on refusal or the deadline."""
    try:
        with exchange(context, address, deadline, channels) as channel:
            return _request_pull(channel, request)
    except wire.WireError as error:
        raise PullFailed(str(error)) from error


def _request_pull(channel: Channel, request: wire.PullBlocks | wire.PullOverLink) -> wire.PullHeader:
    channel.send(request)
    return check_pull_header(channel.receive_message(), request)

