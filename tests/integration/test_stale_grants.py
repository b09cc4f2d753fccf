"""Stale device grants on a provisioned sim host (real LXC): a rule for a major that was NVIDIA's
and is no longer is removed (backed up, reported), at boot too; a rule for a major that was never
NVIDIA's stays byte for byte; `health` reports a stale grant and changes nothing.

    python -m pytest -q --slow tests/integration/test_stale_grants.py
"""

from __future__ import annotations

import json

import pytest

from ops.host.gpu import MAJOR_HISTORY, read_major_history
from ops.sim.host import reboot_host
from tests.helpers.site import check_of, sim_site, statuses

pytestmark = [pytest.mark.lxc, pytest.mark.slow]

CONFIG = "/etc/pve/lxc/200.conf"
HAND_RULE = "lxc.cgroup2.devices.allow: c 511:* rwm\n"  # the incident's own fix, added by hand
USER_RULE = "lxc.cgroup2.devices.allow:   c 240:* rwm \n"  # the user's, spelt the user's way


@pytest.fixture(scope="module")
def site(tmp_path_factory, hub_root):
    with sim_site(tmp_path_factory.mktemp("site"), hub_root, uvm_major=511) as site:
        code, document = site.ddops("provision", "--ct", "200")
        assert code == 0, document
        yield site


def backups_holding(site, line: str) -> list[str]:
    backups = site.root / "var/lib/ddops/backups"
    return [p.name for p in backups.glob("etc__pve__lxc__200.conf.*") if line in p.read_text()]


def test_provision_records_the_hosts_nvidia_majors(site):
    assert {195, 511} <= set(read_major_history(site.t))
    assert site.t.read_text(MAJOR_HISTORY).startswith("# Majors NVIDIA drivers have held")


def test_two_reboots_later_the_hand_added_rule_is_gone_and_the_users_stays(site):
    config = site.t.read_text(CONFIG)
    site.t.write_file(CONFIG, config + HAND_RULE + USER_RULE)

    reboot_host(site.root, uvm_major=509)  # the boot unit runs `ddops recover --at-boot`
    reboot_host(site.root, uvm_major=507)

    after = site.t.read_text(CONFIG)
    assert HAND_RULE not in after
    assert USER_RULE in after  # byte for byte, spacing and all
    assert backups_holding(site, HAND_RULE)
    record = json.loads(site.t.read_text("/var/lib/ddops/last-recover/200.json"))
    assert record["trigger"] == "boot" and record["ok"]
    assert {509, 507} <= set(read_major_history(site.t))
    code, document = site.ddops("health", "--ct", "200")
    assert code == 0, document
    assert set(statuses(document).values()) == {"ok"}


def test_the_boot_record_names_the_stale_grant_it_removed(site):
    config = site.t.read_text(CONFIG)
    site.t.write_file(CONFIG, config + "lxc.cgroup2.devices.allow: c 509:* rwm\n")
    reboot_host(site.root, uvm_major=505)
    record = json.loads(site.t.read_text("/var/lib/ddops/last-recover/200.json"))
    done = {r["key"]: r["done"] for r in record["repaired"]}
    assert "removing stale grant(s) `lxc.cgroup2.devices.allow: c 509:* rwm`" in done["ct-config"]
    assert USER_RULE in site.t.read_text(CONFIG)


def test_health_reports_a_stale_grant_and_changes_nothing(site):
    config = site.t.read_text(CONFIG) + "lxc.cgroup2.devices.allow: c 507:* rwm\n"
    site.t.write_file(CONFIG, config)
    code, document = site.ddops("health", "--ct", "200")
    assert code == 1
    assert "c 507:* rwm` is a stale grant" in check_of(document, "ct-config")["evidence"]
    assert site.t.read_text(CONFIG) == config
    code, document = site.ddops("recover", "--ct", "200")
    assert code == 0, document
    assert "c 507:" not in site.t.read_text(CONFIG)
