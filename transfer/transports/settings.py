"""Settings of one end of a link, and what a backend is handed to build its end."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import torch
import zmq

AUTO = "auto"


@dataclass(frozen=True)
class TransportSettings:
    # "auto" (CUDA tensors -> nccl, both ends on one host -> zmq-ipc, else zmq-tcp; where both
    # ends run nixl, that choice and nixl are measured at set-up: ``probing``) or a backend
    # name forcing it; both ends must then agree. Shaped-link benchmarks force
    # zmq-tcp: ipc sockets live in the file system and bypass network namespaces.
    backend: str = AUTO
    # The address this end binds and advertises for zmq-tcp and torch.distributed.
    host: str = "127.0.0.1"
    # Where zmq-ipc links put their socket files; empty: the system's temporary directory.
    ipc_dir: str = ""
    # The backends this end hosts when it is a link's sender (a peer asks, this end binds and
    # waits); None: what ``backend`` implies (``selection.hosted_backends``).
    hosted: tuple[str, ...] | None = None

    @property
    def ipc_directory(self) -> str:
        return self.ipc_dir or tempfile.gettempdir()


@dataclass(frozen=True)
class LinkOptions:
    """One end's device (where its frames live), settings, and optional ZeroMQ context."""

    device: torch.device
    settings: TransportSettings = TransportSettings()
    zmq_context: zmq.Context | None = None

    def context(self) -> zmq.Context:
        return self.zmq_context or zmq.Context.instance()
