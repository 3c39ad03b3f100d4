"""Error handlers: every failure leaves as OpenAI's ``{"error": {...}}`` shape, client
mistakes as 4xx naming what to fix, everything else as a 5xx without internals."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.errors import ERROR_TYPES, APIError, error_body, install_handlers

SECRET = "db-password=hunter2 at /srv/internal/path.py"


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    count: int = Field(default=1, ge=1)
    tags: list[str] = []


class Outer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[Item] = Field(min_length=1)


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_handlers(app)

    @app.post("/items")
    async def create(item: Item):
        return {"ok": item.name, "count": item.count}

    @app.post("/outer")
    async def outer(body: Outer):
        return {"n": len(body.items)}

    @app.get("/busy")
    async def busy():
        raise APIError(503, "cannot serve right now: no live decode worker", code="no_worker",
                       headers={"Retry-After": "5"})

    @app.get("/teapot")
    async def teapot():
        raise APIError(429, "slow down", param="rate", code="rate_limited")

    @app.get("/odd")
    async def odd():
        raise APIError(418, "short and stout")

    @app.get("/private")
    async def private():
        raise HTTPException(401, "missing API key", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/crash")
    async def crash():
        raise RuntimeError(SECRET)

    @app.get("/crash-sync")
    def crash_sync():
        raise KeyError(SECRET)

    # raise_server_exceptions=False: see what a client sees, not the re-raised error.
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def assert_openai_shape(response, status: int) -> dict:
    assert response.status_code == status
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["type"] == ERROR_TYPES.get(status, "server_error")
    return body["error"]


def test_valid_request_passes_through(client):
    response = client.post("/items", json={"name": "a", "count": 2})
    assert response.status_code == 200
    assert response.json() == {"ok": "a", "count": 2}


@pytest.mark.parametrize("raw", ['{"name": "a",', "not json", '{"name": "a"}}', "{'name': 'a'}"])
def test_invalid_json(client, raw):
    response = client.post("/items", content=raw, headers={"content-type": "application/json"})
    error = assert_openai_shape(response, 400)
    assert error["code"] == "invalid_json"
    assert error["message"] == "the request body is not valid JSON"
    assert error["param"] is None
    assert error["type"] == "invalid_request_error"


def test_missing_field_names_the_parameter(client):
    error = assert_openai_shape(client.post("/items", json={"count": 2}), 400)
    assert error["param"] == "name"
    assert error["code"] == "missing"
    assert error["message"].startswith("name: ")
    assert "required" in error["message"].lower()


def test_extra_field_is_an_unknown_parameter(client):
    error = assert_openai_shape(client.post("/items", json={"name": "a", "colour": "red"}), 400)
    assert error["message"] == "unknown parameter 'colour'"
    assert error["param"] == "colour"
    assert error["code"] == "extra_forbidden"


@pytest.mark.parametrize("body, param, code", [
    ({"name": "a", "count": 0}, "count", "greater_than_equal"),
    ({"name": "a", "count": "many"}, "count", "int_parsing"),
    ({"name": 5}, "name", "string_type"),
    ({"name": "a", "tags": "x"}, "tags", "list_type"),
    ({"name": "a", "tags": ["ok", 3]}, "tags.1", "string_type"),
])
def test_invalid_values_name_the_parameter(client, body, param, code):
    error = assert_openai_shape(client.post("/items", json=body), 400)
    assert error["param"] == param
    assert error["code"] == code
    assert error["message"].startswith(f"{param}: ")


@pytest.mark.parametrize("body, param, message", [
    ({"items": [{"name": "a", "bogus": 1}]}, "items.0.bogus", "unknown parameter 'items.0.bogus'"),
    ({"items": [{"name": "a"}, {}]}, "items.1.name", None),
    ({"items": []}, "items", None),
])
def test_nested_locations_are_dotted(client, body, param, message):
    error = assert_openai_shape(client.post("/outer", json=body), 400)
    assert error["param"] == param
    if message:
        assert error["message"] == message


@pytest.mark.parametrize("body", [[1, 2], "text", 3])
def test_body_of_the_wrong_type(client, body):
    error = assert_openai_shape(client.post("/items", json=body), 400)
    assert error["param"] is None
    assert error["code"] != "invalid_json"


def test_missing_body(client):
    error = assert_openai_shape(client.post("/items"), 400)
    assert error["code"] == "missing"


def test_api_error_keeps_status_headers_and_body(client):
    response = client.get("/busy")
    assert_openai_shape(response, 503)
    assert response.headers["retry-after"] == "5"
    assert response.json() == {"error": {"message": "cannot serve right now: no live decode worker",
                                         "type": "service_unavailable", "param": None, "code": "no_worker"}}


def test_api_error_param_and_type(client):
    error = assert_openai_shape(client.get("/teapot"), 429)
    assert error == {"message": "slow down", "type": "rate_limit_error", "param": "rate", "code": "rate_limited"}


def test_api_error_with_unlisted_status(client):
    response = client.get("/odd")
    assert response.status_code == 418
    assert response.json()["error"]["type"] == "server_error"
    assert "retry-after" not in response.headers


@pytest.mark.parametrize("path", ["/crash", "/crash-sync"])
def test_unexpected_exception_is_a_generic_500(client, path, caplog):
    with caplog.at_level(logging.ERROR, logger="kvroute.orchestrator.errors"):
        response = client.get(path)
    error = assert_openai_shape(response, 500)
    assert error["message"] == "internal error; see the orchestrator log"
    assert error["type"] == "server_error"
    assert error["param"] is None and error["code"] is None
    text = response.text
    assert "hunter2" not in text and "Traceback" not in text and "Error" not in text.replace("error", "")
    # The details go to the log instead.
    assert any(SECRET in (record.exc_text or "") or SECRET in str(record.exc_info) for record in caplog.records)


def test_unknown_route_is_a_404_in_the_same_shape(client):
    error = assert_openai_shape(client.get("/v1/nowhere"), 404)
    assert error["type"] == "not_found_error"
    assert error["message"] == "Not Found"
    assert error["param"] is None and error["code"] is None


def test_wrong_method_is_a_405_in_the_same_shape(client):
    response = client.get("/items")
    error = assert_openai_shape(response, 405)
    assert error["type"] == "invalid_request_error"
    assert error["message"] == "Method Not Allowed"
    # The HTTP exception's own headers survive the reshaping.
    assert response.headers["allow"] == "POST"


def test_http_exception_keeps_status_detail_and_headers(client):
    response = client.get("/private")
    error = assert_openai_shape(response, 401)
    assert error == {"message": "missing API key", "type": "authentication_error", "param": None, "code": None}
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (404, "not_found_error"), (413, "invalid_request_error"),
                                          (500, "server_error"), (502, "server_error")])
def test_error_body(status, kind):
    assert error_body(status, "m", "p", "c") == {"error": {"message": "m", "type": kind, "param": "p", "code": "c"}}
    assert APIError(status, "m").body() == {"error": {"message": "m", "type": kind, "param": None, "code": None}}
