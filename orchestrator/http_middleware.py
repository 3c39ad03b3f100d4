"""ASGI middleware of the HTTP frontend, written against the raw ASGI interface.

Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``) runs every request
through an extra task group and memory stream; on the request path of a serving system
that is measurable overhead per request, so these wrap ``send`` instead.
"""

from __future__ import annotations

from orchestrator.errors import APIError, error_response
from orchestrator.metrics import Metrics


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class BodySizeLimit:
    """Refuse a request whose declared body is over ``limit`` bytes with 413, unread."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            length = _header(scope, b"content-length")
            if length is not None and length.isdigit() and int(length) > self.limit:
                response = error_response(APIError(413, f"request body over {self.limit} bytes",
                                                   code="request_too_large"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
