"""kvroute's lines in processes kvroute does not start (vLLM's engine processes): shown once on
standard error where nothing logs them, left alone where the process already does."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging, sys
from foundation.log_setup import show_kvroute_logs
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.WARNING, format="ROOT %(message)s")
show_kvroute_logs()
show_kvroute_logs()
logging.getLogger("kvroute.transfer.worker").info("staging leases into an arena")
logging.getLogger("other").info("not kvroute's")
"""


def run(mode: str) -> str:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True,
                          timeout=60).stderr


def test_kvroute_info_lines_reach_standard_error_once_in_a_bare_process():
    lines = run("bare").splitlines()
    assert len(lines) == 1 and lines[0].endswith("INFO kvroute.transfer.worker: staging leases into an arena"), lines


def test_a_process_that_configured_logging_keeps_its_own_rules():
    assert run("configured") == ""  # its root handler at WARNING drops the INFO line, as it chose
