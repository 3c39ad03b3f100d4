"""A minimal HTTP/1.1 keep-alive client for overhead measurements.

A general-purpose client costs milliseconds of Python per request (httpx: about 2.5 ms
of CPU per small completion on a 2-core EPYC), which on a small machine lands on the
same cores and inside the same latency as the server it measures. This one does only
what an OpenAI-style POST needs: one connection, ``Content-Length`` request bodies,
responses framed by ``Content-Length`` or ``Transfer-Encoding: chunked`` (how uvicorn
streams SSE), and nothing else (no redirects, proxies, TLS or compression).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass


class LeanHTTPError(Exception):
    pass


@dataclass
class Head:
    status: int
    headers: dict[str, str]  # lower-cased names


class LeanConnection:
    """One keep-alive connection; one request at a time (callers serialise or pool)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        # A stream its caller stopped reading leaves the rest of its body on the socket; an
        # abandoned async generator is finalised only later, so the next request checks.
        self._unread = False

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._unread and self._writer is not None:
            self._writer.close()
            self._writer, self._unread = None, False
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self._reader, self._writer

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except OSError:
                pass
            self._writer = None

    async def _send(self, path: str, body: dict) -> tuple[asyncio.StreamReader, Head]:
        reader, writer = await self._connection()
        payload = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        return reader, await read_head(reader)

    async def post_json(self, path: str, body: dict) -> tuple[int, dict]:
        """POST a JSON body; the status and the decoded JSON answer."""
        reader, head = await self._send(path, body)
        data = b"".join([piece async for piece in read_body(reader, head)])
        self._close_if_asked(head)
        return head.status, json.loads(data) if data else {}

    async def post_sse(self, path: str, body: dict) -> AsyncIterator[str]:
        """POST and yield each server-sent event's ``data:`` payload; raises on a non-200."""
        reader, head = await self._send(path, body)
        if head.status != 200:
            detail = b"".join([piece async for piece in read_body(reader, head)])
            raise LeanHTTPError(f"HTTP {head.status}: {detail[:300]!r}")
        pending, self._unread = b"", True
        async for piece in read_body(reader, head):
            pending += piece
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:].decode()
        self._unread = False
        self._close_if_asked(head)

    def _close_if_asked(self, head: Head) -> None:
        if head.headers.get("connection", "").lower() == "close" and self._writer is not None:
            self._writer.close()
            self._writer = None


async def read_head(reader: asyncio.StreamReader) -> Head:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as error:
        raise LeanHTTPError("connection closed before a response") from error
    status_line, *lines = raw[:-4].decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise LeanHTTPError(f"not an HTTP/1.x status line: {status_line!r}")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Head(int(parts[1]), headers)


async def read_body(reader: asyncio.StreamReader, head: Head) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive, framed by Content-Length or chunked encoding."""
    if head.headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # no trailers are sent: the final empty line
                return
            chunk = await reader.readexactly(size + 2)
            yield chunk[:-2]
    elif "content-length" in head.headers:
        length = int(head.headers["content-length"])
        if length:
            yield await reader.readexactly(length)
    else:
        raise LeanHTTPError("response has neither Content-Length nor chunked encoding")
