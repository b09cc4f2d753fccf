"""ops/chain/install.py: ddops and the host's own site file on the Proxmox host, for recovery at
boot with nobody acting. Here on a simulated host reached locally (the wrapper path); the SSH
path (a venv from a wheel over SFTP) runs in tests/integration/test_remote_boot.py.

    python -m pytest -q tests/ops/chain/test_install.py
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ops.chain import install as host_install
from ops.host.transport import LocalTransport
from ops.host.wheel import ddops_version
from ops.render import RecoverUnit, render
from ops.sim.boot import unit_env
from ops.sim.host import destroy_host, init_host
from ops.site.inventory import parse_site
from tests.helpers.site import inventory_document


@pytest.fixture
def host(tmp_path: Path):
    root = tmp_path / "pve"
    init_host(root, gpus=1, containers="process")
    yield LocalTransport(sysroot=str(root))
    destroy_host(root)


def site_text(t: LocalTransport) -> str:
    site = parse_site(inventory_document(Path(t.sysroot), "http://127.0.0.1:1"), "test")
    (pve,) = site.hosts
    return host_install.host_site_text(t, pve, site.model, site.engine)


def test_the_host_gets_this_ddops_and_its_site_file_then_nothing_changes(host):
    text = site_text(host)
    assert host_install.host_problems(host, text) == [
        "/usr/local/bin/ddops does not run on the host",
        "/etc/ddops/site.yml is missing",
    ]
    assert host_install.install_host_ddops(host, dry_run=True).startswith("would write")
    assert (
        host_install.write_host_site(host, text, dry_run=True) == "would write /etc/ddops/site.yml"
    )
    assert not host.exists(host_install.HOST_DDOPS) and not host.exists(host_install.HOST_SITE)

    assert host_install.install_host_ddops(host, dry_run=False).startswith(
        f"wrote /usr/local/bin/ddops: ddops {ddops_version()} of "
    )
    assert host_install.installed_version(host) == ddops_version()  # it really runs
    assert host_install.write_host_site(host, text, dry_run=False) == "wrote /etc/ddops/site.yml"
    assert host_install.host_problems(host, text) == []
    assert host_install.install_host_ddops(host, dry_run=False) is None
    assert host_install.write_host_site(host, text, dry_run=False) is None

    host.write_file(host_install.HOST_SITE, text.replace("budget: 4", "budget: 8"))
    assert host_install.host_problems(host, text) == [
        "/etc/ddops/site.yml differs from the inventory's part for this host"
    ]


def _keys(node: object) -> Iterator[str]:
    """Every mapping key in a YAML document, at any depth."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key).lower()
            yield from _keys(value)
    elif isinstance(node, list):
        for item in node:
            yield from _keys(item)


def test_the_site_file_names_the_host_itself_holds_no_secret_and_reads_back_the_same(host):
    text = site_text(host)
    document = yaml.safe_load(text)
    (name,) = document["all"]["hosts"]
    assert document["all"]["hosts"][name]["ddops_target"] == f"sim:{host.sysroot}"
    secrets = [k for k in _keys(document) if re.search(r"(^|_)(key|token|secret|password)$", k)]
    assert secrets == [], secrets  # kv_cache_tokens counts tokens: it holds none
    again = parse_site(document, "site.yml")
    (pve,) = again.hosts
    assert host_install.host_site_text(host, pve, again.model, again.engine) == text
    assert host_install.local_target(LocalTransport()) == "local"  # ddops on a real host


def test_a_stale_host_ddops_is_named_with_both_versions(host, monkeypatch):
    host_install.install_host_ddops(host, dry_run=False)
    monkeypatch.setattr(host_install, "ddops_version", lambda: "9.9.9")
    problems = host_install.host_problems(host, site_text(host))
    assert problems[0] == f"/usr/local/bin/ddops is ddops {ddops_version()}, this is ddops 9.9.9"


def test_hf_token_is_stored_root_only_and_reaches_the_boot_unit(host):
    assert host_install.store_hf_token(host, "hf_secret_1", dry_run=True).startswith("would")
    assert not host.exists(host_install.HF_TOKEN_FILE)
    done = host_install.store_hf_token(host, "hf_secret_1", dry_run=False)
    assert done == "stored HF_TOKEN in /etc/ddops/hf-token.env (0600)" and "hf_secret" not in done
    stored = Path(host.host_path(host_install.HF_TOKEN_FILE))
    assert stored.stat().st_mode & 0o777 == 0o600
    assert host_install.hf_token_problem(host, "hf_secret_1") is None
    assert host_install.store_hf_token(host, "hf_secret_1", dry_run=False) is None
    assert host_install.hf_token_problem(host, "hf_other") is not None

    unit = Path(host.sysroot) / "etc/systemd/system/ddops-recover.service"
    unit.write_text(render(RecoverUnit(vmids=(200,), env_file=host_install.HF_TOKEN_FILE)))
    assert unit_env(Path(host.sysroot), unit)["HF_TOKEN"] == "hf_secret_1"  # as systemd reads it
    stored.unlink()
    assert "HF_TOKEN" not in unit_env(Path(host.sysroot), unit)  # "-": optional
