"""A Gloo link's rendezvous store listens on the worker's own interface only, not on every
interface (torch's store binds by itself to all of them; docs/security.md)."""

from __future__ import annotations

import os
import time

import torch

from testing.stack import listening_sockets
from transfer.transports.distributed import DistributedBackend
from transfer.transports.settings import LinkOptions, TransportSettings


def test_the_gloo_rendezvous_store_listens_on_the_given_interface_only():
    hosted = DistributedBackend("gloo").host(LinkOptions(torch.device("cpu"), TransportSettings(host="127.0.0.1")),
                                             time.monotonic() + 10)
    try:
        port = int(hosted.address.split("/")[0].rsplit(":", 1)[1])
        bound = [address for address, listening_port in listening_sockets(os.getpid()) if listening_port == port]
        assert bound == ["127.0.0.1"], bound
    finally:
        hosted.cancel()
