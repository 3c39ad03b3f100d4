"""``kvroute bench replay``'s refusals that need no server: an unknown workload, and a server
that refuses policy overrides (its refusal body faked)."""

from __future__ import annotations

import httpx
import pytest

from kvroute.bench.replay_server import ReplayError, ReplayServer
from kvroute.cli import main
from orchestrator.errors import error_body


def test_unknown_workload_is_refused_before_connecting(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "replay", "--url", "http://127.0.0.1:9", "--workload", "nope", "--output", str(tmp_path)])
    assert "unknown workload 'nope'; choose one of repository-assistant" in capsys.readouterr().err


def test_server_without_policy_override_says_how_to_fix_it():
    # The orchestrator's own refusal body, as it sends it without --allow-policy-override.
    refusal = error_body(400, "X-KVRoute-Policy needs the orchestrator's --allow-policy-override",
                         param="X-KVRoute-Policy", code="policy_override_disabled")
    server = ReplayServer("http://cluster", transport=httpx.MockTransport(lambda _: httpx.Response(400, json=refusal)))
    with pytest.raises(ReplayError, match="start the orchestrator with --allow-policy-override"):
        server.check_policies("model", ["round_robin"])
