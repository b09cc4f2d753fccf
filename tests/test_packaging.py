"""Packaging: every Python package is listed in pyproject, and shipped data is found."""

from __future__ import annotations

import tomllib
from pathlib import Path

from ops.resources import playbooks_dir, templates_dir

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_in_pyproject():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("ops", "engine")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_templates_and_playbooks_resolve_to_the_shipped_directories():
    assert templates_dir().resolve() == (ROOT / "templates").resolve()
    assert playbooks_dir().resolve() == (ROOT / "playbooks").resolve()
