"""Heartbeats: the worker's load and identity, published on a ZMQ PUB socket."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from kvroute import wire
from kvroute.netutil import async_context

HEARTBEAT_TOPIC = b"heartbeat"


async def publish_heartbeats(bind_address: str, make: Callable[[float], wire.Heartbeat],
                             interval_seconds: float) -> None:
    """Publish ``make(now)`` every interval until cancelled."""
    socket = async_context().socket(zmq.PUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(bind_address)
    try:
        while True:
            await socket.send_multipart([HEARTBEAT_TOPIC, wire.encode(make(time.time()))])
            await asyncio.sleep(interval_seconds)
    finally:
        socket.close(linger=0)
