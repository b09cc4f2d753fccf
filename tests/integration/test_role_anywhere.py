"""The ddops_chain role from a playbook of the user's own, in a directory of its own: the role is
self-contained (its modules, module_utils and templates inside it), so naming it on the roles
path is all it takes. --syntax-check, then a --check run against a sim host from nothing.

    python -m pytest -q --slow tests/integration/test_role_anywhere.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ops.ansible import search_path
from ops.resources import playbooks_dir
from tests.helpers.site import sim_site

pytestmark = [pytest.mark.ansible, pytest.mark.slow]

USERS_PLAYBOOK = [
    {
        "name": "GPU containers, my way",
        "hosts": "all",
        "gather_facts": False,
        "roles": [{"role": "ddops_chain", "vars": {"ddops_mode": "provision"}}],
    }
]


def ansible_playbook(where: Path, inventory: Path, *args: str) -> subprocess.CompletedProcess:
    """ansible-playbook run from `where` (the user's directory, nothing of ddops in it), with
    ddops' roles on the roles path and no other configuration."""
    env = {
        **os.environ,
        "ANSIBLE_ROLES_PATH": str(playbooks_dir() / "roles"),
        "ANSIBLE_CONFIG": str(where / "none.cfg"),  # not a file: ansible's defaults
        "ANSIBLE_NOCOLOR": "1",
    }
    ansible = shutil.which("ansible-playbook", path=search_path())  # as ops runs it
    assert ansible is not None
    argv = [ansible, "-i", str(inventory), "site.yml", *args]
    return subprocess.run(argv, cwd=where, env=env, capture_output=True, text=True, timeout=600)


def host_files(root: Path) -> list[Path]:
    """The sim host's files, its logs and the sim's own bookkeeping (lock, state) aside."""
    return sorted(
        p.relative_to(root)
        for p in root.rglob("*")
        if p.is_file() and "log" not in p.name and "var/lib/ddops-sim" not in str(p)
    )


def test_a_users_playbook_elsewhere_checks_a_sim_host_with_the_role(tmp_path, hub_root):
    with sim_site(tmp_path / "site", hub_root) as site:
        mine = tmp_path / "my-playbooks"
        mine.mkdir()
        (mine / "site.yml").write_text(yaml.safe_dump(USERS_PLAYBOOK, sort_keys=False))
        document = yaml.safe_load(site.inventory.read_text())
        host = document["all"]["hosts"]["pve"]
        host |= {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
        inventory = mine / "inventory.yml"
        inventory.write_text(yaml.safe_dump(document))

        checked = ansible_playbook(mine, inventory, "--syntax-check")
        assert checked.returncode == 0, checked.stdout + checked.stderr

        before = host_files(site.root)
        planned = ansible_playbook(mine, inventory, "--check", "--diff")
        assert planned.returncode == 0, planned.stdout[-3000:] + planned.stderr[-2000:]
        recap = planned.stdout.rsplit("PLAY RECAP", 1)[1]
        assert "failed=0" in recap and "unreachable=0" in recap
        assert (
            "+Before=pve-guests.service" in planned.stdout
        )  # the boot unit, from the role's templates
        assert host_files(site.root) == before  # check mode: nothing written
