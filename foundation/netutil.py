"""Small helpers for addresses and ports."""

from __future__ import annotations

import random
import socket

# Below Linux's default ephemeral range (32768-60999): the kernel hands ports from that range
# to outgoing connections, and one may take a port picked here before its listener binds it
# (seen: vLLM's KV-event publisher failing with "Address already in use" at start-up).
LISTEN_PORT_RANGE = (20000, 32767)
_PORT_ATTEMPTS = 200


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now (the caller binds it soon after), outside the range
    the kernel gives outgoing connections; the kernel's own pick if none is found."""
    for _ in range(_PORT_ATTEMPTS):
        port = random.randint(*LISTEN_PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def tcp(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def peer_address(frame) -> str:
    """The address a received ZeroMQ message (any ``zmq.Frame`` of it) came from, as libzmq
    saw its connection: for naming a peer in a warning."""
    import zmq

    try:
        return frame.get("Peer-Address") or "a peer without an address (ipc)"
    except zmq.ZMQError:
        return "a peer of unknown address"


_async_context = None


def async_context():
    """The process's asyncio ZMQ context.

    Not ``zmq.asyncio.Context.instance()``: that shares its singleton slot with the
    synchronous ``zmq.Context.instance()`` and may hand back a non-async context.
    """
    global _async_context
    import zmq.asyncio

    if _async_context is None or _async_context.closed:
        _async_context = zmq.asyncio.Context()
    return _async_context


def flush_async_context(linger_ms: int = 2000) -> None:
    """At exit: close every socket of the asyncio context, sending what is still queued for
    up to ``linger_ms`` (a worker's last reply may still sit in ZeroMQ's queue when its
    server stops), then end the context. A process that exits without this drops them."""
    if _async_context is not None and not _async_context.closed:
        _async_context.destroy(linger=linger_ms)
