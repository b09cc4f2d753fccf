"""Run-time imports against pyproject's declarations, with deptry (configured in pyproject.toml).

Two passes, because an extra's modules may import it but the control plane may not:
- the whole project, `dev` the only dev-only extra: an undeclared import, a transitive one, or a
  tests-only package imported by shipped code fails;
- the control plane alone (engine/ left out), `engine` dev-only too: `ops` importing torch,
  transformers or fastapi fails (it runs on hosts without the engine extra).
Each pass is also shown to fail when such an import is added, on a copy of the tree.

    python -m pytest -q tests/test_dependencies.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO as ROOT

WHOLE_PROJECT: list[str] = []
CONTROL_PLANE = [
    "--optional-dependencies-dev-groups",
    "dev,engine",
    "--extend-exclude",
    "engine/.*",
]


def deptry(root: Path, *options: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "deptry", ".", "--no-ansi", *options]
    return subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("options", [WHOLE_PROJECT, CONTROL_PLANE], ids=["project", "ops"])
def test_every_run_time_import_is_declared_where_it_is_used(options):
    result = deptry(ROOT, *options)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    """The sources deptry reads (pyproject, ops/, engine/, playbooks/), copied."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for top in ("ops", "engine", "playbooks"):
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("*.safetensors"))
    return tmp_path


@pytest.mark.parametrize(
    ("module", "source", "options", "rule"),
    [
        ("ops/plot_more.py", "import pytest\n", WHOLE_PROJECT, "DEP004 'pytest'"),
        (
            "engine/fetch.py",
            "import requests_oauthlib\n",
            WHOLE_PROJECT,
            "DEP001 'requests_oauthlib'",
        ),
        ("ops/gpu_memory.py", "def f():\n    import torch\n", CONTROL_PLANE, "DEP004 'torch'"),
    ],
    ids=["tests-only-in-ops", "undeclared-in-engine", "engine-extra-in-ops"],
)
def test_an_undeclared_or_misplaced_import_fails(tree_copy, module, source, options, rule):
    (tree_copy / module).write_text(source)
    result = deptry(tree_copy, *options)
    said = result.stdout + result.stderr
    assert result.returncode == 1
    assert f"{module}:" in said and rule in said
