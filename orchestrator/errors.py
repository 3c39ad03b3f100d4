"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause maps to a 4xx with a message that says what to fix;
anything else becomes a 5xx without internals (the details go to the log).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("kvroute.orchestrator.errors")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def validation_error(error: RequestValidationError) -> APIError:
    first = error.errors()[0] if error.errors() else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        message = f"unknown parameter '{param}'"
    elif param:
        message = f"{param}: {message}"
    return APIError(400, message, param=param, code=first.get("type"))


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        return error_response(validation_error(error))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException):
        # ``code``: set by kvroute's own HTTP exceptions (orchestrator.http_middleware.BodyTooLarge)
        return error_response(APIError(error.status_code, str(error.detail), code=getattr(error, "code", None),
                                       headers=error.headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, "internal error; see the orchestrator log"))
