"""The layers hold: the import contracts in ``pyproject.toml`` pass on the tree, fail on a
tree with a forbidden import, and the router starts without torch or vLLM."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
while not (ROOT / "pyproject.toml").is_file():
    ROOT = ROOT.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def root_packages() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["importlinter"]["root_packages"]


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    # The tree's own folder first on the path, so its packages are the ones analysed.
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def scratch_tree(tmp_path_factory) -> Path:
    """A copy of the project's packages and its ``pyproject.toml``, to break on purpose."""
    tree = tmp_path_factory.mktemp("tree")
    shutil.copy(ROOT / "pyproject.toml", tree)
    for package in root_packages():
        shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tree


def add_import(tree: Path, module: str, statement: str) -> None:
    path = tree / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{statement}\n")


def test_the_contracts_pass_on_the_tree(scratch_tree):
    result = lint_imports(scratch_tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, statement, contract", [
    ("orchestrator.disagg", "import transfer.block_client", "The router is torch-free"),
    ("orchestrator.service", "import torch", "The router is torch-free"),
    ("orchestrator.planner.views", "from orchestrator import metrics", "The planner is pure"),
    ("foundation.wire", "import orchestrator.errors", "Layers"),
    ("transfer.leases", "import orchestrator.index", "Layers"),
    ("worker.process", "import testing.stack", "Layers"),
    ("kvroute.serve", "import kvroute.bench.replay", "Product code never imports bench"),
])
def test_a_forbidden_import_breaks_its_contract(scratch_tree, tmp_path, module, statement, contract):
    tree = tmp_path / "tree"
    shutil.copytree(scratch_tree, tree)
    add_import(tree, module, statement)
    result = lint_imports(tree)
    assert result.returncode != 0, f"{statement!r} in {module} passed the contracts"
    broken = [line for line in result.stdout.splitlines() if line.rstrip().endswith("BROKEN")]
    assert any(contract in line for line in broken), result.stdout


def test_the_router_imports_neither_torch_nor_vllm():
    code = ("import sys, orchestrator.app; "
            "print(','.join(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"orchestrator.app imported {result.stdout.strip()}"
