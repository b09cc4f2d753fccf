"""The default site of a simulated host (`--host sim:PATH`, no inventory) on real LXC: provision,
then health exits 0, and stays so across reboots: the host's site file names the host's own hub.

    python -m pytest -q --slow tests/integration/test_default_site.py
"""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from ops.cli import cli
from ops.host.transport import LocalTransport
from ops.sim import hubservice
from ops.sim.host import destroy_host, init_host, reboot_host

pytestmark = [pytest.mark.lxc, pytest.mark.slow]


def ct(host, *argv: str) -> str:
    t = LocalTransport(sysroot=str(host))
    return t.run(["pct", "exec", "200", "--", *argv]).check("CT 200").stdout


def assert_least_privilege(host) -> None:
    """The new CT is unprivileged (its root is 100000 on the host), the GPU nodes belong to the
    engine's group, and the engine process runs as ddops-engine, not root, without privileges."""
    config = (host / "etc/pve/lxc/200.conf").read_text()
    assert "unprivileged: 1\n" in config and "dev0: /dev/nvidia0,gid=44\n" in config
    assert ct(host, "cat", "/proc/self/uid_map").split() == ["0", "100000", "65536"]
    assert ct(host, "stat", "-c", "%u %g %a", "/dev/nvidia-uvm").split() == ["0", "44", "660"]
    engine_pid = json.loads(ct(host, "cat", "/run/ddops/engine.status"))["engine_pid"]
    status = dict(
        line.split(":\t", 1)
        for line in ct(host, "cat", f"/proc/{engine_pid}/status").splitlines()
        if ":\t" in line
    )
    uid = int(status["Uid"].split()[0])
    assert ct(host, "awk", "-F:", f"$3 == {uid} {{ print $1 }}", "/etc/passwd").strip() == (
        "ddops-engine"
    )
    assert status["Gid"].split()[0] == "44" and status["NoNewPrivs"].strip() == "1"
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0


def not_ok(document: dict) -> list[str]:
    """`key: status: evidence -> action` of each check that did not pass, for the message."""
    checks = [c for ct in document["cts"] for c in ct["checks"]]
    return [
        f"{c['key']}: {c['status']}: {c['evidence']} -> {c['action']}"
        for c in checks
        if c["status"] not in ("ok", "unchanged", "changed")
    ]


def ddops(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, ["--json", *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture
def host(tmp_path):
    root = tmp_path / "pve"
    init_host(root, containers="lxc")
    yield root
    destroy_host(root)


def test_provision_then_health_is_healthy_and_stays_so_after_reboots(host):
    target = f"sim:{host}"
    code, document = ddops("--host", target, "provision", "--ct", "200")
    assert code == 0, not_ok(document)
    code, document = ddops("--host", target, "health", "--ct", "200")
    assert code == 0, not_ok(document)

    assert_least_privilege(host)

    site = yaml.safe_load((host / "etc/ddops/site.yml").read_text())
    assert site["all"]["vars"]["ddops_model"]["hub_endpoint"] == hubservice.hub_url(host)
    for major in (509, 507):  # the boot unit's recovery stages from the host's hub each time
        reboot_host(host, uvm_major=major)
        code, document = ddops("--host", target, "health", "--ct", "200")
        assert code == 0, not_ok(document)
    code, document = ddops("--host", target, "provision", "--ct", "200")  # a second run
    assert code == 0, not_ok(document)
    assert {c["status"] for c in document["cts"][0]["checks"]} == {"unchanged"}
