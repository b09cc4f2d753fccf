"""Where the shipped data lives: playbooks/, and the templates inside its ddops_chain role.

In a source checkout playbooks/ sits beside ops/ (and templates/ at the top is a link to the
role's templates: the role is self-contained, the CLI renders the same files); an installed wheel
carries it as the data package ops.playbooks (see pyproject.toml).
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
    """The directory of the Jinja2 templates shared by the CLI and the playbooks: the
    ddops_chain role's own, so the role works from wherever a playbook names it."""
    return playbooks_dir() / "roles" / "ddops_chain" / "templates"


def playbooks_dir() -> Path:
    """The directory of the Ansible playbooks."""
    return _shipped("playbooks")
