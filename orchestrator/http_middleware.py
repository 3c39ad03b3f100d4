"""ASGI middleware of the HTTP frontend, written against the raw ASGI interface.

Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``) runs every request
through an extra task group and memory stream; on the request path of a serving system
that is measurable overhead per request, so these wrap ``send`` instead.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.errors import APIError, error_response
from orchestrator.metrics import Metrics


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive`` when a body passes the limit. An HTTP exception, so FastAPI's
    body reading lets it through to the error handlers (any other exception there becomes
    a 400). ``Connection: close``: the server stops reading the rest of the body."""

    code = "request_too_large"

    def __init__(self, limit: int):
        super().__init__(413, f"request body over {limit} bytes (--max-request-bytes)",
                         headers={"Connection": "close"})


class BodySizeLimit:
    """Refuse a request whose body is over ``limit`` bytes with 413: unread when its
    Content-Length says so, else as soon as the bytes received pass the limit (a chunked
    body declares no length; nothing is buffered beyond the limit)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _too_large(BodyTooLarge(self.limit))(scope, receive, send)
            return
        received = 0
        started = False

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def send_noting_start(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive_within_limit, send_noting_start)
        except BodyTooLarge as error:  # read outside FastAPI's body parsing, so not answered yet
            if started:
                raise
            await _too_large(error)(scope, receive, send)


def _too_large(error: BodyTooLarge):
    return error_response(APIError(413, str(error.detail), code=error.code, headers=error.headers))


class RequestCounter:
    """Counts every HTTP request by matched route and status once it has been answered."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the server's outermost error handler answers if the app raises

        async def send_and_note_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            # The matched route, not the raw path: unknown paths must not mint new series.
            endpoint = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(endpoint, str(status)).inc()
