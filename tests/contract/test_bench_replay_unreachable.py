"""``kvroute bench replay`` against a port nobody listens on: a clear error, not a traceback."""

from __future__ import annotations

from kvroute.cli import main


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    code = main(["bench", "replay", "--url", "http://127.0.0.1:9", "--workload", "repository-assistant",
                 "--output", str(tmp_path)])
    assert code == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().out
