"""A raw torch.distributed baseline for the transports' Gloo backend.

The same bytes in the same frames between the same two processes, moved with nothing
but torch: a two-rank Gloo group built straight from ``TCPStore``, ``PrefixStore`` and
``ProcessGroupGloo`` (no global ``init_process_group``), page-touched buffers allocated
before timing, and one blocking ``send`` or ``recv`` per frame. No header, no gather,
no scatter, no buffer pool: the wire alone. It shares no code with
``transfer.transports.distributed`` on purpose, so a fault there cannot hide in both.

Usage, one side each::

    store, address = host_store()          # rank 0, e.g. the sender
    # address travels to the peer by any means
    group = pair_group(store, rank=0)      # blocks until the peer joined
    group = pair_group(connect_store(address), rank=1)
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

_GROUP_PREFIX = "kvroute-raw-dist"
_TAG = 0


def host_store(host: str = "127.0.0.1", timeout: float = 60.0) -> tuple[TCPStore, str]:
    """A rendezvous store on a free port, and the ``host:port`` the peer connects to."""
    store = TCPStore(host, 0, 2, True, timedelta(seconds=timeout), wait_for_workers=False)
    return store, f"{host}:{store.port}"


def connect_store(address: str, timeout: float = 60.0) -> TCPStore:
    host, _, port = address.rpartition(":")
    return TCPStore(host, int(port), 2, False, timedelta(seconds=timeout))


def pair_group(store: TCPStore, rank: int, host: str = "127.0.0.1", timeout: float = 60.0):
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(PrefixStore(_GROUP_PREFIX, store), rank, 2, options)


def touched_frames(frame_bytes: int, num_frames: int) -> list[torch.Tensor]:
    """Frames whose pages are all mapped, as a live KV cache's are."""
    return [torch.full((frame_bytes,), index % 251, dtype=torch.uint8) for index in range(num_frames)]


def send_frames(group, frames: list[torch.Tensor], peer: int) -> int:
    for frame in frames:
        group.send([frame], peer, _TAG).wait()
    return sum(frame.numel() for frame in frames)


def receive_frames(group, buffers: list[torch.Tensor], peer: int) -> int:
    for buffer in buffers:
        group.recv([buffer], peer, _TAG).wait()
    return sum(buffer.numel() for buffer in buffers)
