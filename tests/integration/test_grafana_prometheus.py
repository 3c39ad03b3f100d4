"""The dashboard and the rules against a real Prometheus scraping a real orchestrator.

``promtool`` checks the rules file and runs its alert cases (deploy/prometheus/
kvroute-rules.test.yml). Then an orchestrator with synthetic prefill and decode workers
(whose decode workers act out their KV pulls, so transfers are measured) serves completions
in two rounds, a scrape apart, so every counter and histogram has grown between two samples;
one tenant also goes over its rate limit in each. Prometheus scrapes it every second with the
rules loaded. Every query of every dashboard panel, and every recording rule, must then
return data, and every one a finite number somewhere: a NaN-only answer means the panel
would show nothing."""

from __future__ import annotations

import json
import subprocess

import httpx
import openai
import pytest

from foundation.model_prep import resolve_model
from testing.stack import SyntheticStack
from tests.dashboard_queries import RULE_TESTS, RULES, panel_queries, rules
from tests.integration.prometheus_server import finite_values, require_binaries, running_prometheus

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"sk-ops": {"tenant": "ops", "admin": True, "rate_limit": 0},
        "sk-steady": {"tenant": "steady", "rate_limit": 0},
        "sk-bursty": {"tenant": "bursty", "rate_limit": 0.001, "burst": 1}}  # one request, then 429s
PROMPT = "Summarise the history of the printing press in Europe. " * 40  # several synthetic blocks
RATE_INTERVAL = "1m"  # what Grafana's $__rate_interval becomes at a 1 s scrape interval and a short range


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    require_binaries()
    folder = tmp_path_factory.mktemp("grafana")
    keys = folder / "keys.json"
    keys.write_text(json.dumps({"keys": KEYS}))
    stack = SyntheticStack(resolve_model(None), folder / "stack.log",
                           ["--api-keys", str(keys), "--allow-policy-override"], token_seconds=0.002,
                           worker_args=("--pull-bytes-per-second", "2e9"))
    try:
        stack.wait_healthy(120)
        yield stack
    finally:
        stack.stop()


def test_promtool_accepts_the_rules_and_their_alert_cases():
    require_binaries()
    for command in (["promtool", "check", "rules", str(RULES)], ["promtool", "test", "rules", str(RULE_TESTS)]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def serve_round(stack) -> int:
    """Completions and chat completions from a steady tenant, two from a tenant over its
    limit; returns the placements made."""
    steady = openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-steady", max_retries=0)
    for i in range(3):
        steady.completions.create(model=MODEL, prompt=f"{i} {PROMPT}", max_tokens=8, temperature=0)
    # The cache-aware planner serves these prompts on the idle decode worker (LOCAL); a baseline
    # policy always splits them (DISAGG), so KV moves and the transfer panels have data.
    steady.completions.create(model=MODEL, prompt=f"split {PROMPT}", max_tokens=8, temperature=0,
                              extra_headers={"X-KVRoute-Policy": "least_loaded"})
    steady.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
                                   temperature=0)
    bursty = openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-bursty", max_retries=0)
    served = 5
    for _ in range(2):  # its burst of one is spent by the first of all: at least one 429 a round
        try:
            bursty.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
            served += 1
        except openai.RateLimitError:
            pass
    return served


def test_every_panel_and_recording_rule_has_data(stack, tmp_path):
    target = stack.url.removeprefix("http://")
    with running_prometheus(tmp_path, target, [RULES]) as prometheus:
        prometheus.wait_for('up{job="kvroute"}', lambda r: r and r[0]["value"][1] == "1", timeout=20)
        placed = serve_round(stack)
        prometheus.wait_for("sum(kvroute_plans_total)", lambda r: r and float(r[0]["value"][1]) == placed, 20)
        placed += serve_round(stack)  # a scrape later: every series now grew between two samples
        prometheus.wait_for("sum(kvroute_plans_total)", lambda r: r and float(r[0]["value"][1]) == placed, 20)
        prometheus.wait_for('sum(kvroute_rate_limited_total{tenant="bursty"})',
                            lambda r: r and float(r[0]["value"][1]) == 3, 20)
        for rule in rules("record"):  # evaluated every second: at most a couple to wait
            prometheus.wait_for(rule["record"], finite_values, 10)

        empty, not_finite = [], []
        for title, expr in panel_queries(RATE_INTERVAL):
            result = prometheus.query(expr)
            if not result:
                empty.append((title, expr))
            elif not finite_values(result):
                not_finite.append((title, expr, result))
        assert not empty, f"panel queries without data: {empty}"
        assert not not_finite, f"panel queries with no finite value: {not_finite}"

        transfers = prometheus.query(f"sum(rate(kvroute_transfer_bytes_total[{RATE_INTERVAL}]))")
        assert float(transfers[0]["value"][1]) > 0  # the disaggregated path ran, not only local plans
        assert httpx.get(stack.url + "/health", timeout=5).status_code == 200
