"""Which backend a link uses: the same pure decision on both ends, from both hellos.

Automatic: CUDA frames on both ends -> nccl; both ends on one host -> zmq-ipc; else
zmq-tcp. Gloo is never chosen automatically for CPU frames (ZeroMQ is the faster
host-memory path here) but can be forced, as can any backend: an override on either end
wins when the other end runs it; two different overrides refuse the link.

The sender hosts the link, so it offers only the backends it was configured for
(``hosted_backends``): hosting Gloo or NCCL makes it wait for the peer to join a
process group, and the fake backend works only within one process, so a peer asking
for one of those from an endpoint not set up for it is refused at first contact,
before anything binds or waits.
"""

from __future__ import annotations

import torch

from foundation.wire import LinkHello
from transfer.transports import distributed, fake, nixl_backend, zmq_backend
from transfer.transports.base import Backend
from transfer.transports.errors import LinkRefused
from transfer.transports.settings import AUTO, TransportSettings

BACKENDS: dict[str, Backend] = {
    "fake": fake.BACKEND,
    "zmq-tcp": zmq_backend.TCP,
    "zmq-ipc": zmq_backend.IPC,
    "gloo": distributed.GLOO,
    "nccl": distributed.NCCL,
    "nixl": nixl_backend.NIXL,  # forced only, for now: not in AUTOMATIC
}


def backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise LinkRefused(f"unknown transport backend {name!r}; known: {sorted(BACKENDS)}") from None


# What "auto" may choose, and what an endpoint can host without waiting for anyone: a
# ZeroMQ link is a bind that returns at once.
AUTOMATIC = ("nccl", "zmq-ipc", "zmq-tcp")
HOSTED_AT_ONCE = ("zmq-ipc", "zmq-tcp")


def runnable_backends(device: torch.device) -> list[str]:
    """The backends this process can run for frames on ``device``."""
    return [name for name, candidate in BACKENDS.items() if candidate.supports(device)]


def hosted_backends(settings: TransportSettings) -> tuple[str, ...]:
    """The backends a sender with ``settings`` hosts for a peer that asks: ``settings.hosted``
    when set; under "auto" what auto may choose; with a backend forced, that one and the
    ZeroMQ ones."""
    if settings.hosted is not None:
        return settings.hosted
    if settings.backend == AUTO:
        return AUTOMATIC
    return (settings.backend, *(name for name in HOSTED_AT_ONCE if name != settings.backend))


def choose_backend(local: LinkHello, remote: LinkHello) -> str:
    """The link's backend; both ends compute it and the receiver checks they agree."""
    requested = {hello.requested for hello in (local, remote)} - {AUTO}
    if len(requested) > 1:
        raise LinkRefused(f"the two ends force different backends: {sorted(requested)}")
    name = requested.pop() if requested else _automatic(local, remote)
    backend(name)  # an unknown name is refused with the list of known ones
    for end, hello in (("local", local), ("remote", remote)):
        if name not in hello.backends:
            why = _why_not(name) if end == "local" else ""
            raise LinkRefused(f"backend {name} cannot run on the {end} end, or is not one it takes "
                              f"({hello.device} frames; it takes {hello.backends}){why}")
    return name


def _why_not(name: str) -> str:
    """A backend's own reason it cannot run in this process, where it has one (nixl)."""
    unavailable = getattr(backend(name), "unavailable", None)
    reason = unavailable() if unavailable is not None else ""
    return f": {reason}" if reason else ""


def _automatic(local: LinkHello, remote: LinkHello) -> str:
    if local.device == remote.device == "cuda":
        return "nccl"
    if "cuda" in (local.device, remote.device):
        raise LinkRefused(f"no backend moves frames between {local.device} and {remote.device} memory")
    return "zmq-ipc" if local.host_id == remote.host_id else "zmq-tcp"
