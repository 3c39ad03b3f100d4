"""Which backend a link uses: the same pure decision on both ends, from both hellos.

Automatic: CUDA frames on both ends -> nccl; both ends on one host -> zmq-ipc; else
zmq-tcp. Gloo is never chosen automatically for CPU frames (ZeroMQ is the faster
host-memory path here) but can be forced, as can any backend: an override on either end
wins when the other end runs it; two different overrides refuse the link.

Where both ends run nixl as well, "auto" does not assume either is faster: the link set-up
measures both (``measured_candidates``, then ``probing``) and keeps the faster
(``fastest_candidate``). Without nixl on both ends, nothing is measured. NIXL moves KV in
clear, so between two hosts it is a candidate only where neither end encrypts KV on its
ZeroMQ links: "auto" never trades the encryption an operator left on for speed.

The sender hosts the link, so it offers only the backends it was configured for
(``hosted_backends``): hosting Gloo or NCCL makes it wait for the peer to join a
process group, and the fake backend works only within one process, so a peer asking
for one of those from an endpoint not set up for it is refused at first contact,
before anything binds or waits.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    "nixl": nixl_backend.NIXL,
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
# What "auto" chooses only when a probe at link set-up finds it faster than the automatic
# choice: nixl's speed against ZeroMQ depends on UCX's transports, message sizes and
# encryption, so it is measured rather than assumed.
MEASURED = ("nixl",)


def runnable_backends(device: torch.device) -> list[str]:
    """The backends this process can run for frames on ``device``."""
    return [name for name, candidate in BACKENDS.items() if candidate.supports(device)]


def hosted_backends(settings: TransportSettings) -> tuple[str, ...]:
    """The backends a sender with ``settings`` hosts for a peer that asks: ``settings.hosted``
    when set; under "auto" what auto may choose, measured ones included; with a backend forced, that one and the
    ZeroMQ ones."""
    if settings.hosted is not None:
        return settings.hosted
    if settings.backend == AUTO:
        return (*AUTOMATIC, *MEASURED)
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


def measured_candidates(local: LinkHello, remote: LinkHello) -> tuple[str, ...]:
    """What the link set-up measures before choosing, in order: the automatic choice, then
    each measured backend both ends run. Empty when there is nothing to measure (an end
    forces a backend, no measured backend runs on both, or the ends are on two hosts and
    either encrypts KV): the automatic choice stands. Both ends compute it from the same
    two hellos, so they probe the same candidates."""
    if local.requested != AUTO or remote.requested != AUTO:
        return ()
    if local.host_id != remote.host_id and (local.kv_encrypted or remote.kv_encrypted):
        return ()
    automatic = _automatic(local, remote)
    measured = [name for name in MEASURED if name != automatic and name in local.backends
                and name in remote.backends]
    return (automatic, *measured) if measured else ()


def fastest_candidate(candidates: Sequence[str], seconds: Sequence[float | None]) -> str | None:
    """The candidate of least measured ``seconds`` (None: it was not measured, and is never
    chosen); on a tie the earlier one, so the automatic choice keeps a tie. None when no
    candidate was measured."""
    if len(seconds) != len(candidates):
        raise ValueError(f"{len(seconds)} measurements for {len(candidates)} candidates")
    measured = [(elapsed, position) for position, elapsed in enumerate(seconds) if elapsed is not None]
    return candidates[min(measured)[1]] if measured else None


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
