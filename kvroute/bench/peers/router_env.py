"""vllm-router, pinned, in a virtual environment of its own, installed the first time a peer needs it.

vllm-router is a Rust binary shipped as a PyPI wheel (``vllm-router``, with a Python launcher).
It is not a dependency of kvroute: it goes into ``.peers-venv/`` at the checkout's root
(git-ignored), created with ``python -m venv`` and ``pip install vllm-router==0.1.17``, so
kvroute's own environment never changes and every run measures the same router release.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from kvroute.bench.paths import REPO_ROOT

ROUTER_PACKAGE = "vllm-router"
ROUTER_VERSION = "0.1.17"
DEFAULT_VENV = REPO_ROOT / ".peers-venv"
INSTALL_TIMEOUT_S = 900


class RouterUnavailable(Exception):
    """vllm-router could not be installed here; the peers that need it are skipped with this reason."""


def router_binary(venv: Path) -> Path:
    return venv / "bin" / "vllm-router"


def installed(venv: Path, version: str = ROUTER_VERSION) -> bool:
    """The pinned release is in ``venv`` (its dist-info folder) with its launcher."""
    dist_info = list(venv.glob(f"lib/python*/site-packages/vllm_router-{version}.dist-info"))
    return bool(dist_info) and router_binary(venv).exists()


def ensure_router(venv: Path = DEFAULT_VENV, say: Callable[[str], None] = print,
                  python: str = sys.executable) -> Path:
    """The vllm-router launcher of the pinned release, installed into ``venv`` if missing;
    raises ``RouterUnavailable`` with pip's last lines if that fails."""
    if installed(venv):
        return router_binary(venv)
    say(f"installing {ROUTER_PACKAGE}=={ROUTER_VERSION} into {venv} (first use of a vllm-router peer; "
        "later runs reuse it)")
    steps = ([python, "-m", "venv", str(venv)],
             [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
              f"{ROUTER_PACKAGE}=={ROUTER_VERSION}"])
    for command in steps:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise RouterUnavailable(f"{' '.join(command[:3])}: {error}") from None
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise RouterUnavailable(f"{' '.join(command[:3])} failed ({done.returncode}): {tail}")
    if not installed(venv):
        raise RouterUnavailable(f"pip finished but {venv} has no {ROUTER_PACKAGE} {ROUTER_VERSION}")
    say(f"installed {ROUTER_PACKAGE} {ROUTER_VERSION}")
    return router_binary(venv)
