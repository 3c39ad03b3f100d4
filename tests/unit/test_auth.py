"""API keys and roles (orchestrator.auth), the cross-site rule for admin actions
(orchestrator.cross_site) and the refusal to serve a non-loopback host without keys.
Over HTTP, with a real server: tests/integration/test_http_security.py."""

from __future__ import annotations

import json

import pytest
import yaml

from foundation.config import ConfigError
from orchestrator.auth import ANONYMOUS, ApiKeys, Principal, require_admin
from orchestrator.cross_site import check_not_cross_site
from orchestrator.errors import APIError
from orchestrator.settings import OrchestratorSettings, is_loopback


def key_file(tmp_path, data, suffix: str = ".yaml"):
    path = tmp_path / f"keys{suffix}"
    path.write_text(yaml.safe_dump(data) if suffix == ".yaml" else json.dumps(data))
    return path


def test_admin_keys_and_tenant_keys(tmp_path):
    keys = ApiKeys.from_file(key_file(tmp_path, {"keys": {
        "sk-ops": {"tenant": "ops", "admin": True}, "sk-a": {"tenant": "team-a", "scope": "s1"},
        "sk-b": "team-b", "sk-c": {"tenant": "team-c", "admin": False}}}))
    assert keys.authenticate("Bearer sk-ops") == Principal("ops", "default", admin=True)
    assert keys.authenticate("Bearer sk-a") == Principal("team-a", "s1", admin=False)
    assert not keys.authenticate("Bearer sk-b").admin and not keys.authenticate("Bearer sk-c").admin
    require_admin(keys.authenticate("Bearer sk-ops"))
    with pytest.raises(APIError) as refused:
        require_admin(keys.authenticate("Bearer sk-a"))
    assert refused.value.status == 403 and refused.value.body()["error"]["type"] == "permission_error"


def test_without_keys_everyone_is_the_anonymous_admin():
    assert ApiKeys.disabled().authenticate(None) is ANONYMOUS and ANONYMOUS.admin
    require_admin(ANONYMOUS)


@pytest.mark.parametrize("data, says", [
    ({}, "expected a top-level 'keys:' mapping"),
    ({"keys": {}}, "expected a top-level 'keys:' mapping"),
    ({"keys": None}, "expected a top-level 'keys:' mapping"),
    ({"keys": ["sk-a-secret"]}, "expected a top-level 'keys:' mapping"),
    ({"sk-a-secret": {"tenant": "a"}}, "found 'sk_a…'"),  # keys without the 'keys:' mapping
    ({"keys": {"sk-a-secret": {"tenant": "a"}}, "admins": ["sk-a-secret"]}, "found 'admi…'"),
    ({"keys": {"sk-a-secret": {"tenant": "a", "admn": True}}},
     "unknown fields 'admn'; a key's fields are tenant, scope"),
    ({"keys": {"sk-a-secret": {"tenant": "a", "admin": "yes"}}}, "needs admin: true or false"),
    ({"keys": {"sk-a-secret": {"scope": "s"}}}, "needs a tenant"),
    ({"keys": {"sk-a-secret": ""}}, "needs a tenant"),
    ({"keys": {"sk-a-secret": 7}}, "needs a tenant"),
])
def test_key_files_kvroute_cannot_read_fully_stop_the_start(tmp_path, data, says):
    for suffix in (".yaml", ".json"):
        with pytest.raises(ConfigError) as refused:
            ApiKeys.from_file(key_file(tmp_path, data, suffix))
        assert says in str(refused.value)
        assert "secret" not in str(refused.value)  # a four-character hint of a key at most


def json_post(**headers) -> dict:
    return {"content-type": "application/json", **headers}


@pytest.mark.parametrize("method, headers", [
    ("GET", {}), ("HEAD", {"origin": "https://evil.example"}), ("OPTIONS", {}),
    ("POST", json_post()), ("POST", {"content-type": "Application/JSON; charset=utf-8"}),
    ("DELETE", json_post(**{"sec-fetch-site": "same-origin"})), ("POST", json_post(**{"sec-fetch-site": "none"})),
    ("POST", json_post(origin="http://127.0.0.1:8000", host="127.0.0.1:8000")),
])
def test_requests_no_form_could_send_pass(method, headers):
    check_not_cross_site(method, headers)


@pytest.mark.parametrize("headers, status, code", [
    ({}, 415, "json_content_type_required"),
    ({"content-type": "application/x-www-form-urlencoded"}, 415, "json_content_type_required"),
    ({"content-type": "text/plain"}, 415, "json_content_type_required"),
    ({"content-type": "multipart/form-data; boundary=x"}, 415, "json_content_type_required"),
    (json_post(**{"sec-fetch-site": "cross-site"}), 403, "cross_site_request"),
    (json_post(**{"sec-fetch-site": "same-site"}), 403, "cross_site_request"),
    (json_post(origin="https://evil.example", host="127.0.0.1:8000"), 403, "cross_site_request"),
    (json_post(origin="http://127.0.0.1:9999", host="127.0.0.1:8000"), 403, "cross_site_request"),
    (json_post(origin="null", host="127.0.0.1:8000"), 403, "cross_site_request"),
])
def test_state_changes_a_browser_could_send_cross_site_are_refused(headers, status, code):
    with pytest.raises(APIError) as refused:
        check_not_cross_site("POST", headers)
    assert (refused.value.status, refused.value.code) == (status, code)


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True),
                                            ("::1", True), ("[::1]", True), ("0.0.0.0", False), ("::", False),
                                            ("10.0.0.1", False), ("", False), ("my-host", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) == loopback


@pytest.mark.parametrize("values", [{"host": "0.0.0.0"}, {"host": "10.0.0.5"},
                                    {"admin_port": 9000, "admin_host": "0.0.0.0"}])
def test_an_exposed_listener_needs_keys_or_an_explicit_opt_out(values):
    with pytest.raises(ValueError, match="without --api-keys.*--allow-unauthenticated"):
        OrchestratorSettings(**values)
    OrchestratorSettings(**values, api_keys="keys.yaml")
    OrchestratorSettings(**values, allow_unauthenticated=True)


def test_the_admin_host_matters_only_with_an_admin_port():
    OrchestratorSettings(admin_host="0.0.0.0")
    assert not OrchestratorSettings().separate_admin_listener
    assert OrchestratorSettings(admin_port=9000).http_server_options(admin=True)["port"] == 9000
