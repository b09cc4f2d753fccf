"""Packaging: every Python package is listed in pyproject, and shipped data is found."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from ops.resources import playbooks_dir, templates_dir
from tests.helpers import REPO as ROOT


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


def test_every_tracked_symlink_points_inside_the_repository():
    """A link committed by mistake (a worktree's .venv, say) dangles in a clean clone and breaks
    whatever creates that path there."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-s"], capture_output=True, text=True, check=True
    ).stdout
    links = [line.split("\t", 1)[1] for line in listed.splitlines() if line.startswith("120000 ")]
    outside = [link for link in links if not (ROOT / link).resolve().is_relative_to(ROOT.resolve())]
    assert not outside, f"tracked links leaving the repository: {outside}"


def test_templates_and_playbooks_resolve_to_the_shipped_directories():
    assert templates_dir().resolve() == (ROOT / "templates").resolve()
    assert playbooks_dir().resolve() == (ROOT / "playbooks").resolve()


def test_an_installed_ops_finds_its_templates_inside_the_package(tmp_path):
    """The layout of an installed wheel (no pyproject beside it): the role's templates in
    ops/playbooks in site-packages."""
    package = tmp_path / "site-packages" / "ops"
    templates = package / "playbooks" / "roles" / "ddops_chain" / "templates"
    templates.mkdir(parents=True)
    (templates / "x.j2").write_text("x")
    (package / "__init__.py").write_text("")
    shutil.copy(ROOT / "ops" / "resources.py", package / "resources.py")
    code = "from ops.resources import templates_dir; print(templates_dir())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path / "site-packages")},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == str(templates) and (Path(out) / "x.j2").is_file()
