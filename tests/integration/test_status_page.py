"""The status page (``/ui``) in a real headless Chromium, against an orchestrator with
synthetic-engine workers, API keys and a separate admin listener: the page asks for an
admin key, then shows the workers; a completion sent with the ``openai`` client appears
as a decision with its plan, estimate and actual; the page is screenshotted.

``KVROUTE_UPDATE_DOCS_SCREENSHOT=1`` also writes the screenshot to
``docs/images/status-page.png``, the one the README shows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from foundation.model_prep import resolve_model
from foundation.netutil import free_port
from testing.browser import Browser, find_chromium
from testing.stack import SyntheticStack

MODEL = "SmolLM2-135M-Instruct"
ADMIN, TENANT = "sk-status-admin", "sk-status-tenant"
MORE_REQUESTS = 6
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "status-page.png"

# On Linux, `make setup` installs Debian's chromium, so a missing one is a failure there.
pytestmark = pytest.mark.skipif(find_chromium() is None and sys.platform != "linux",
                                reason="no Chromium on this platform (make setup installs it on Debian)")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("status_page")
    keys = folder / "keys.json"
    keys.write_text(json.dumps({"keys": {ADMIN: {"tenant": "ops", "admin": True}, TENANT: {"tenant": "team-a"}}}))
    admin_port = free_port()
    stack = SyntheticStack(resolve_model(None), folder / "stack.log",
                           ["--api-keys", str(keys), "--admin-port", str(admin_port),
                            # one-second buckets: a few seconds of requests draw lines, not a dot
                            "--status-window-seconds", "60", "--status-bucket-seconds", "1"], token_seconds=0.02)
    stack.admin_url = f"http://127.0.0.1:{admin_port}"
    try:
        stack.wait_healthy(120)
        yield stack
    finally:
        stack.stop()


def test_the_page_is_a_data_free_shell_under_a_strict_policy_on_the_admin_listener(stack):
    page = httpx.get(stack.admin_url + "/ui", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", page.text, re.S)
    assert scripts and all(body.strip() == "" and 'src="ui/' in attributes for attributes, body in scripts)
    assert "prefill-0" not in page.text and "http://" not in page.text.replace("http://www.w3.org", "")
    for path in ("/ui", "/ui/status.js", "/ui/status.css"):
        headers = httpx.get(stack.admin_url + path, timeout=10).headers
        policy = headers["content-security-policy"]
        assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy, path
        assert "unsafe-inline" not in policy and headers["x-content-type-options"] == "nosniff", path
    # Its data is the admin's; the API listener serves neither.
    assert httpx.get(stack.admin_url + "/admin/status", timeout=10).status_code == 401
    tenant = {"Authorization": f"Bearer {TENANT}"}
    assert httpx.get(stack.admin_url + "/admin/status", headers=tenant, timeout=10).status_code == 403
    assert httpx.get(stack.url + "/ui", timeout=10).status_code == 404
    assert httpx.get(stack.url + "/admin/status", timeout=10).status_code == 404


def test_chromium_shows_the_workers_then_a_request_s_decision(stack, tmp_path):
    with Browser.launch(tmp_path / "profile", log_path=tmp_path / "chromium.log") as browser:
        page = browser.open(stack.admin_url + "/ui")
        page.wait_for("!document.getElementById('key-form').hidden", timeout=15)  # 401: asks for a key
        page.evaluate(f"document.getElementById('key').value = {json.dumps(ADMIN)};"
                      "document.getElementById('key-form').requestSubmit()")
        workers = page.wait_for(
            "(() => { const ids = [...document.querySelectorAll('#workers tbody tr')].map(r => r.dataset.worker);"
            "  return ids.length === 2 && ids; })()", timeout=15)
        assert sorted(workers) == ["decode-0", "prefill-0"]
        assert page.evaluate("sessionStorage.getItem('kvroute.adminKey')") == ADMIN
        # The style sheet and the script's CSSOM writes got past the policy.
        assert page.evaluate("getComputedStyle(document.querySelector('.tile')).display") == "flex"
        assert page.evaluate("document.querySelector('#workers .bar > span').style.width").endswith("%")

        client = openai.OpenAI(base_url=stack.url + "/v1", api_key=TENANT, max_retries=0)
        prompt = "Summarise the status page for an operator. " * 8
        completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        row = page.wait_for(f"document.querySelector('#decisions tr[data-response=\"{completion.id}\"]')"
                            f"?.innerText", timeout=15)
        cells = [cell.strip() for cell in row.split("\t")]
        assert cells[2:4] == ["team-a", "cache_aware"], cells
        assert re.fullmatch(r"(disagg|local) .*decode-0", cells[4]), cells[4]
        assert re.fullmatch(r"[\d.]+ m?s → [\d.]+ m?s", cells[5]), cells[5]  # estimate → actual, both known
        assert cells[6].endswith(f"of {completion.usage.prompt_tokens}"), cells[6]
        assert re.match(r"\d+ other plans?", cells[7]), cells[7]
        assert page.wait_for("document.getElementById('requests').textContent === '1'", timeout=10)
        assert re.fullmatch(r"[\d.]+ m?s", page.evaluate("document.getElementById('ttft-p50').textContent"))

        for number in range(MORE_REQUESTS):  # over a few one-second buckets
            client.completions.create(model=MODEL, prompt=f"{prompt} Request {number}.", max_tokens=6)
            time.sleep(0.5)
        assert page.wait_for(f"document.getElementById('requests').textContent === '{1 + MORE_REQUESTS}'", 10)
        points = ("[...document.querySelectorAll('#ttft-chart .p50')].reduce((n, shape) => n + "
                  "(shape.tagName === 'circle' ? 1 : shape.getAttribute('points').split(' ').length), 0)")
        assert page.wait_for(f"{points} >= 3", timeout=10)  # a point per bucket with requests
        assert page.evaluate("document.querySelectorAll('#decisions tbody tr').length") == 1 + MORE_REQUESTS

        shot = page.screenshot(tmp_path / "status-page.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if os.environ.get("KVROUTE_UPDATE_DOCS_SCREENSHOT"):
        DOCS_SCREENSHOT.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, DOCS_SCREENSHOT)
