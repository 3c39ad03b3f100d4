"""Opening a link end over a caller's control channel, and keeping one per peer.

``open_sender`` and ``open_receiver`` run the first contact (``handshake``), pick the
backend (``selection``), then build the backend's end: the sender hosts, the receiver
joins. Where "auto" has candidates to measure, both ends set up and probe each and keep
the one the receiver found fastest (``probing``). ``LinkTable`` opens a peer's link on its
first use and opens a new one after a failure closed it, so links are made lazily, per
worker pair.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch
import zmq

from foundation.wire import KVLayoutSpec, LinkHello, LinkSetup
from foundation.zmq_auth import encrypts_kv
from transfer.memfd import host_identity
from transfer.transports.base import Receiver, Sender
from transfer.transports.control import ControlChannel
from transfer.transports.errors import LinkRefused
from transfer.transports.handshake import RECEIVER, SENDER, exchange_hellos, receive, send
from transfer.transports.probing import measure_as_receiver, measure_as_sender, probe_frames
from transfer.transports.selection import (
    backend,
    choose_backend,
    hosted_backends,
    measured_candidates,
    runnable_backends,
)
from transfer.transports.settings import LinkOptions, TransportSettings


def _hello(role: str, layout: KVLayoutSpec, options: LinkOptions) -> LinkHello:
    """This end as the peer sees it; a sender offers only the backends it hosts."""
    backends = runnable_backends(options.device)
    if role == SENDER:
        hosted = hosted_backends(options.settings)
        backends = [name for name in backends if name in hosted]
    return LinkHello(role=role, layout=layout, device=options.device.type, host_id=host_identity(),
                     backends=backends, requested=options.settings.backend, kv_encrypted=encrypts_kv())


def _options(device: torch.device | str, settings: TransportSettings | None,
             zmq_context: zmq.Context | None) -> LinkOptions:
    return LinkOptions(torch.device(device), settings or TransportSettings(), zmq_context)


def open_sender(control: ControlChannel, layout: KVLayoutSpec, device: torch.device | str, deadline: float,
                settings: TransportSettings | None = None, zmq_context: zmq.Context | None = None) -> Sender:
    """The sending end of a new link; the peer runs ``open_receiver`` at the same time."""
    options = _options(device, settings, zmq_context)
    name, candidates = _first_contact(control, SENDER, layout, options, deadline)

    def host_announced(candidate: str, by: float) -> Sender:
        return _host_and_announce(control, candidate, options, by)

    if candidates:
        return measure_as_sender(control, candidates, probe_frames(layout), host_announced, deadline)
    return host_announced(name, deadline)


def open_receiver(control: ControlChannel, layout: KVLayoutSpec, device: torch.device | str, deadline: float,
                  settings: TransportSettings | None = None, zmq_context: zmq.Context | None = None) -> Receiver:
    """The receiving end of a new link; the peer runs ``open_sender`` at the same time."""
    options = _options(device, settings, zmq_context)
    name, candidates = _first_contact(control, RECEIVER, layout, options, deadline)

    def join_announced(candidate: str, setup: LinkSetup, by: float) -> Receiver:
        return _join_announced(candidate, setup, options, by)

    if candidates:
        return measure_as_receiver(control, candidates, probe_frames(layout), join_announced, deadline)
    return join_announced(name, receive(control, LinkSetup, deadline), deadline)


def _first_contact(control: ControlChannel, role: str, layout: KVLayoutSpec, options: LinkOptions,
                   deadline: float) -> tuple[str, tuple[str, ...]]:
    """Exchange hellos; (the automatic or forced backend, the candidates to measure instead)."""
    local = _hello(role, layout, options)
    remote = exchange_hellos(control, local, deadline)
    return choose_backend(local, remote), measured_candidates(local, remote)


def _host_and_announce(control: ControlChannel, name: str, options: LinkOptions, deadline: float) -> Sender:
    """Host a ``name`` link, tell the peer where (or why not) with a LinkSetup, and accept it."""
    try:
        hosted = backend(name).host(options, deadline)
    except Exception as error:
        send(control, LinkSetup(backend=name, error=str(error)))
        raise
    try:
        send(control, LinkSetup(backend=name, address=hosted.address))
        return hosted.accept(deadline)
    except BaseException:
        hosted.cancel()
        raise


def _join_announced(name: str, setup: LinkSetup, options: LinkOptions, deadline: float) -> Receiver:
    """Join the ``name`` link the sender announced in ``setup``."""
    if setup.error:
        raise LinkRefused(f"the sender could not host a {setup.backend} link: {setup.error}")
    if setup.backend != name:
        raise LinkRefused(f"the ends chose different backends: sender {setup.backend}, receiver {name}")
    return backend(name).join(setup.address, options, deadline)


End = TypeVar("End", Sender, Receiver)


class LinkTable(Generic[End]):
    """Open link ends by peer id. ``open_end(peer_id)`` makes a new one (running the first
    contact with that peer); a closed end is replaced on the next ``get``. Thread-safe."""

    def __init__(self, open_end: Callable[[str], End]):
        self._open_end = open_end
        self._ends: dict[str, End] = {}
        self._lock = threading.Lock()

    def get(self, peer_id: str) -> End:
        with self._lock:
            end = self._ends.get(peer_id)
            if end is None or end.closed:
                end = self._ends[peer_id] = self._open_end(peer_id)
            return end

    def close_all(self) -> None:
        with self._lock:
            ends, self._ends = list(self._ends.values()), {}
        for end in ends:
            end.close()
