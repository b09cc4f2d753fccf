"""Recovery at boot on a remote host, with no hand steps: the usual set-up, ddops on the operator's
machine reaching a Proxmox host over SSH (here a simulated host behind the real sshd on loopback,
`ssh://...?sysroot=`). Provision installs ddops on the host itself (a venv from a wheel of this
ddops over SFTP) and the host's own site file; after `sim reboot` the boot units run that
host-side ddops, and the CT is healthy with no command from the operator; `ddops health` from the
operator's side then shows what the boot-time recovery did.

    python -m pytest -q --slow tests/integration/test_remote_boot.py   # minutes: pip installs ddops's deps
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import yaml

from ops.host.wheel import ddops_version
from ops.sim.host import reboot_host
from tests.helpers.site import sim_site, statuses
from tests.helpers.sshd import running_sshd

pytestmark = [pytest.mark.slow, pytest.mark.lxc, pytest.mark.ssh]


@pytest.fixture
def remote_site(tmp_path, hub_root):
    """A sim site whose host the CLI reaches over SSH, with the operator's key and known_hosts."""
    with running_sshd(tmp_path / "sshd") as server, sim_site(tmp_path, hub_root) as site:
        ssh_dir = Path(os.environ["HOME"]) / ".ssh"  # the test's own HOME (conftest)
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        shutil.copy(server.client_key, ssh_dir / "id_ed25519")
        (ssh_dir / "id_ed25519").chmod(0o600)
        server.write_known_hosts(ssh_dir / "known_hosts")
        document = yaml.safe_load(site.inventory.read_text())
        document["all"]["hosts"]["pve"]["ddops_target"] = f"{server.target}?sysroot={site.root}"
        site.inventory.write_text(yaml.safe_dump(document))
        yield site


def test_provision_over_ssh_then_the_host_recovers_at_boot_by_itself(remote_site, capsys):
    site = remote_site
    code, document = site.ddops("provision", "--ct", "200")
    assert code == 0, document
    host_ddops = next(c for c in document["cts"][0]["checks"] if c["key"] == "host-ddops")
    assert host_ddops["action"].startswith(
        f"installed ddops {ddops_version()} into /opt/ddops/venv, linked /usr/local/bin/ddops"
    )
    assert (site.root / "opt/ddops/venv/bin/ddops").is_file()
    own_site = yaml.safe_load((site.root / "etc/ddops/site.yml").read_text())
    assert own_site["all"]["hosts"]["pve"]["ddops_target"] == f"sim:{site.root}"

    served, start = site.hub.bytes_served, time.monotonic()
    boot = reboot_host(site.root, uvm_major=509)  # nobody acts from here on
    seconds = time.monotonic() - start
    assert boot.units == ["ddops-gpu-nodes", "ddops-recover"]
    log = (site.root / "var/log/ddops-sim.log").read_text()
    ran = "-/usr/local/bin/ddops -i /etc/ddops/site.yml recover --ct 200 --at-boot -> exit 0"
    assert ran in log, log

    code, health = site.ddops("health", "--ct", "200")
    assert code == 0 and set(statuses(health).values()) == {"ok"}, health
    last = health["cts"][0]["last_recover"]
    assert (last["trigger"], last["ok"]) == ("boot", True)
    # devN entries: Proxmox grants the new major itself at start, so the config stays as it is
    assert {"model", "service"} <= {r["key"] for r in last["repaired"]}
    assert site.hub.bytes_served == served  # re-staged from the CT's cache
    with capsys.disabled():
        print(
            f"\nremote host: sim reboot -> healthy engine {seconds:.1f} s "
            f"(boot-time recover {last['seconds']} s), {site.hub.bytes_served - served} bytes "
            "downloaded"
        )

    code, again = site.ddops("provision", "--ct", "200")
    assert code == 0 and set(statuses(again).values()) == {"unchanged"}, again
