"""Where the shipped data lives: templates/ and playbooks/.

In a source checkout they sit beside ops/; an installed wheel carries them as the data
packages ops.templates and ops.playbooks (see pyproject.toml).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def _shipped(name: str) -> Path:
    source = Path(__file__).resolve().parent.parent / name
    if source.is_dir() and (source.parent / "pyproject.toml").is_file():
        return source
    return Path(str(resources.files(f"ops.{name}")))


def templates_dir() -> Path:
    """The directory of the Jinja2 templates shared by the CLI and the playbooks."""
    return _shipped("templates")


def playbooks_dir() -> Path:
    """The directory of the Ansible playbooks."""
    return _shipped("playbooks")
