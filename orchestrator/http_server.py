"""The orchestrator's HTTP listeners: uvicorn servers that bound what one client can hold.

uvicorn bounds open connections (``limit_concurrency``) and idle keep-alive time, but not
how long or how many bytes a client may take to send a request's head: a client sending a
header byte a second holds its connection (slowloris), and httptools, uvicorn's fast
parser, accepts a head of any size. ``BoundedHeadProtocol`` adds both bounds to that parser.

Every listener (the API, and the admin listener where one is configured) runs in one event
loop; ``stop_on_signals`` stops them all on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Sequence

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from orchestrator.settings import OrchestratorSettings


class HeadTooLarge(Exception):
    """Raised from a parser callback; httptools turns it into a parser error (see ``send_400_response``)."""


class BoundedHeadProtocol(HttpToolsProtocol):
    """A request head must be complete within ``head_timeout`` seconds and ``max_head_bytes``
    bytes (request target plus header names and values). The clock starts when the
    connection opens and, on a kept-alive connection, at the next request's first byte
    (until then uvicorn's keep-alive timeout applies). Too slow: the connection is closed.
    Too large: 431, then closed. Configure through ``bounded_head_protocol``."""

    head_timeout: float = 10.0
    max_head_bytes: int = 65536

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_bytes, self._head_timer, self._head_too_large = 0, None, False
        self._start_head()

    def connection_lost(self, exc) -> None:
        self._stop_head_clock()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:  # a further request on a kept-alive connection
            self._start_head()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._stop_head_clock()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if not self._head_too_large:
            super().send_400_response(msg)
            return
        self.logger.warning("Request head over %d bytes; closing the connection.", self.max_head_bytes)
        self.transport.write(STATUS_LINE[431] + b"content-length: 0\r\nconnection: close\r\n\r\n")
        self.transport.close()

    def _start_head(self) -> None:
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _stop_head_clock(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.max_head_bytes:
            self._head_too_large = True
            raise HeadTooLarge()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def bounded_head_protocol(head_timeout: float, max_head_bytes: int) -> type[BoundedHeadProtocol]:
    """uvicorn builds the protocol from its class, so the bounds travel as class attributes."""
    return type("BoundedHeadProtocol", (BoundedHeadProtocol,),
                {"head_timeout": head_timeout, "max_head_bytes": max_head_bytes})


class Listener(uvicorn.Server):
    """uvicorn's own signal handling serves one server and re-raises a captured Ctrl-C after
    shutting down; the orchestrator's listeners stop together through ``stop_on_signals``."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def listeners(apps: Sequence, settings: OrchestratorSettings, graceful_seconds: float) -> list[Listener]:
    """A listener per app: the API first, then the admin app if it has a port of its own."""
    protocol = bounded_head_protocol(settings.header_timeout_seconds, settings.max_header_bytes)
    return [Listener(uvicorn.Config(app, **settings.http_server_options(admin=index > 0), http=protocol,
                                    timeout_graceful_shutdown=graceful_seconds))
            for index, app in enumerate(apps)]


def stop_on_signals(servers: Sequence[uvicorn.Server]) -> None:
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for server in servers:
            server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)


async def serve_all(servers: Sequence[uvicorn.Server]) -> None:
    """Until one listener stops (a signal, or a port it could not bind); then stop the others."""
    tasks = [asyncio.create_task(server.serve()) for server in servers]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
