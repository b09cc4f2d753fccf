"""Where the shipped data lives: templates/ and playbooks/.

In a source checkout they sit beside ops/; an installed wheel carries them as the data
packages ops.templates and ops.playbooks (see pyproject.toml).
"""

from __future__ import annotations

from pathlib import Path


def _shipped(name: str) -> Path:
    here = Path(__file__).resolve().parent
    source = here.parent / name
    if source.is_dir() and (source.parent / "pyproject.toml").is_file():
        return source
    # Installed: ops/<name> in site-packages. (importlib.resources would hand back a
    # MultiplexedPath for these namespace packages, whose str() is no path.)
    return here / name


def templates_dir() -> Path:
    """The directory of the Jinja2 templates shared by the CLI and the playbooks."""
    return _shipped("templates")


def playbooks_dir() -> Path:
    """The directory of the Ansible playbooks."""
    return _shipped("playbooks")
