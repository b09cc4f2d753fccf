"""Issue 38's scenarios end to end on a PVE 9.2 sim host (real LXC, the engine running): kernel and
driver upgrades never leave a GPU container broken, and a boot into a kernel without the module
says why and how back, once.

python -m pytest -q --slow tests/integration/test_upgrade_scenarios.py    (~6 min)
"""

from __future__ import annotations

import pytest

from ops.sim.host import reboot_host, upgrade_host
from tests.helpers.site import check_of, sim_site

OLD, BAD, GOOD, BAD2 = "7.0.14-8-pve", "7.0.14-9-pve", "7.0.14-10-pve", "7.0.14-11-pve"
DRIVER = "590.48.02"
pytestmark = [pytest.mark.lxc, pytest.mark.slow]


def healthy(site) -> dict:
    code, document = site.ddops("health", "--ct", "200")
    assert code == 0, document
    return document


def test_kernel_and_driver_upgrades_keep_cuda_and_a_bad_boot_names_the_way_back(tmp_path, hub_root):
    with sim_site(tmp_path, hub_root, pve_version="9.2.11") as site:
        code, document = site.ddops("provision", "--ct", "200")
        assert code == 0, document
        served = site.hub.bytes_served

        # A kernel whose NVIDIA build fails: the hook pins the running one; the boot keeps it.
        upgrade_host(site.root, kernel_version=BAD, dkms_ok=False)
        said = check_of(healthy(site), "boot-kernel")["evidence"]
        assert (
            f"next boot {OLD}; warning: {BAD} got no nvidia module, so ddops pinned {OLD}" in said
        )
        assert reboot_host(site.root).kernel == OLD
        healthy(site)

        # A kernel that builds: the pin is lifted, the next reboot runs it.
        upgrade_host(site.root, kernel_version=GOOD)
        assert check_of(healthy(site), "boot-kernel")["evidence"].endswith(
            f"next boot {GOOD}, which has nvidia 590.48.01"
        )
        assert reboot_host(site.root).kernel == GOOD
        healthy(site)

        # A driver upgrade: after the reboot the CT's userspace is the host's new one.
        upgrade_host(site.root, driver=DRIVER)
        reboot_host(site.root)
        document = healthy(site)
        assert check_of(document, "cuda")["evidence"] == (
            f"CT 200: cuInit ok, driver {DRIVER} on host and in the CT"
        )
        assert check_of(document, "engine")["status"] == "ok"
        assert site.hub.bytes_served == served  # re-staged from the CT's cache

        # No hook: health warns before the reboot; after it, one line each, and no loop.
        (site.root / "etc/kernel/postinst.d/zz-ddops-nvidia").unlink()
        upgrade_host(site.root, kernel_version=BAD2, dkms_ok=False)
        code, document = site.ddops("health", "--ct", "200")
        assert code == 1
        assert (
            "a reboot now would leave CT(s) 200 without CUDA"
            in (check_of(document, "boot-kernel")["evidence"])
        )
        boot = reboot_host(site.root)
        assert boot.kernel == BAD2 and boot.failed  # the CT's start failed: no nvidia nodes
        code, document = site.ddops("health", "--ct", "200")
        way_back = f"`proxmox-boot-tool kernel pin {GOOD} --next-boot` and reboot"
        modules = check_of(document, "modules")["evidence"]
        assert code == 1 and modules.startswith(f"sim:{site.root}: running kernel {BAD2} has no")
        assert way_back in modules and "\n" not in modules
        last = document["cts"][0]["last_recover"]
        assert last["trigger"] == "boot" and way_back in last["failed"]
        assert "\n" not in last["failed"]
        log = (site.root / "var/log/ddops-sim.log").read_text()
        assert log.count("--ct 200 --at-boot -> exit 1") == 1  # once: no loop
