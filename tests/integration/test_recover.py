"""`ddops recover` and `ddops health` on a provisioned sim host (real LXC), every fault injected
through the sim: issue 5's cases 1-9, and recovery at boot without a person.

    python -m pytest -q --slow tests/integration/test_recover.py

One CT is provisioned for the module (raw cgroup rules, so a moved uvm major leaves a stale
rule behind); each test breaks it, recovers it, and leaves it healthy for the next. The boot
unit that runs `ddops recover` is disabled until the last test, so the cases test the command
itself. The hub counts the file bytes it serves: zero in cases 1-4.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from ops.sim import faults
from ops.sim.host import reboot_host
from tests.helpers.site import (
    DRAFT_REPO,
    TARGET_REPO,
    check_of,
    disable_boot_units,
    make_tiny_hub_root,
    sim_site,
    statuses,
)

pytestmark = [pytest.mark.lxc, pytest.mark.slow]

RECOVER_UNIT = "ddops-recover.service"
GPU_NODES_UNIT = "ddops-gpu-nodes.service"
TARGET_WEIGHTS = "/dev/shm/models/target/model.safetensors"
HOOKSCRIPT_LINE = "hookscript: local:snippets/ddops-hook.sh\n"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    hub_root = make_tiny_hub_root(tmp_path_factory.mktemp("hub"))
    with sim_site(tmp_path_factory.mktemp("site"), hub_root, device_style="raw") as site:
        code, document = site.ddops("provision", "--ct", "200")
        assert code == 0, document
        disable_boot_units(site.root, RECOVER_UNIT)
        yield site


def changed(document: dict) -> set[str]:
    return {key for key, status in statuses(document).items() if status == "changed"}


def recover(site, *args: str) -> dict:
    code, document = site.ddops("recover", "--ct", "200", *args)
    assert code == 0, document
    return document


def assert_healthy(site) -> None:
    code, document = site.ddops("health", "--ct", "200")
    assert code == 0, document
    assert set(statuses(document).values()) == {"ok"}


def test_1_reboot_moves_the_uvm_major_under_raw_rules(site):
    served = site.hub.bytes_served
    reboot_host(site.root, uvm_major=509)
    code, sick = site.ddops("health", "--ct", "200")
    assert code == 1
    assert check_of(sick, "ct-config")["evidence"].startswith(
        "CT 200: /dev/nvidia-uvm major 509 is not allowed by the CT config (allows 511)"
    )
    assert check_of(sick, "cuda") == {**check_of(sick, "cuda"), "status": "skipped"}

    document = recover(site)
    assert {"ct-config", "model", "service"} <= changed(document)
    assert "lxc.cgroup2.devices.allow: c 509:* rwm" in site.t.read_text("/etc/pve/lxc/200.conf")
    assert site.hub.bytes_served == served
    assert_healthy(site)


def test_2_reboot_without_the_uvm_nodes(site):
    served = site.hub.bytes_served
    disable_boot_units(site.root, GPU_NODES_UNIT)
    reboot_host(site.root, uvm_major=490)
    assert site.t.exists("/dev/nvidia-uvm")  # the CT hookscript's pre-start made them
    config = site.t.read_text("/etc/pve/lxc/200.conf")  # a CT set up without the hookscript:
    site.t.write_file("/etc/pve/lxc/200.conf", config.replace(HOOKSCRIPT_LINE, ""))
    reboot_host(site.root, uvm_major=480)
    assert not site.t.exists("/dev/nvidia-uvm")

    document = recover(site)
    assert {"nodes", "ct-config", "model", "service"} <= changed(document)
    assert check_of(document, "nodes")["action"] == "ran `nvidia-modprobe -u -c=0`"
    assert site.hub.bytes_served == served
    assert_healthy(site)


def test_3_only_dev_shm_wiped_is_restaged_from_the_cache(site):
    served = site.hub.bytes_served
    site.ct_sh("rm -rf /dev/shm/models")
    document = recover(site)
    assert changed(document) == {"model"}
    assert re.fullmatch(
        r"staged target@[0-9a-f]{12}: 5 file\(s\) copied, 0 file\(s\) from the hub; "
        r"draft@[0-9a-f]{12}: 2 file\(s\) copied, 0 file\(s\) from the hub",
        check_of(document, "model")["action"],
    )
    assert site.hub.bytes_served == served
    assert site.shm_digests("target") == site.hub_digests(TARGET_REPO)
    assert_healthy(site)


def test_4_killed_engine_and_supervisor_are_restarted(site):
    served = site.hub.bytes_served
    supervisor, engine = site.engine_pids()
    faults.kill_ct_process(site.root, 200, supervisor)
    faults.kill_ct_process(site.root, 200, engine)
    document = recover(site)
    assert "service" in changed(document)
    assert site.engine_pids()[1] != engine
    assert site.hub.bytes_served == served
    assert_healthy(site)


def test_5_stopped_and_locked_ct_needs_unlock(site):
    site.t.run(["pct", "stop", "200"]).check("stop")
    faults.lock_ct(site.root, 200, "backup")
    code, refused = site.ddops("recover", "--ct", "200")
    assert code == 1
    assert check_of(refused, "ct-running")["evidence"] == (
        "CT 200 is locked (backup): once the backup is over, rerun with --unlock "
        "(or `pct unlock 200`)"
    )
    assert "lock: backup" in site.t.read_text("/etc/pve/lxc/200.conf")

    document = recover(site, "--unlock")
    assert (
        check_of(document, "ct-running")["action"] == "ran pct unlock 200 (backup), pct start 200"
    )
    assert_healthy(site)


def test_6_truncated_model_file_is_detected_and_repaired(site):
    faults.truncate_ct_file(site.root, 200, TARGET_WEIGHTS, 100)
    code, sick = site.ddops("health", "--ct", "200")
    assert code == 1
    assert "model.safetensors: 100 bytes, expected" in check_of(sick, "model")["evidence"]
    document = recover(site)
    assert "model" in changed(document)
    assert site.shm_digests("target") == site.hub_digests(TARGET_REPO)
    assert_healthy(site)


def test_7_damaged_cache_is_downloaded_again(site):
    cache = site.root / "var/lib/lxc/200/rootfs/var/cache/ddops/hf/models--ddops--tiny-target"
    blob = next(cache.glob("snapshots/*/model.safetensors")).resolve()
    size = blob.stat().st_size
    blob.write_bytes(b"x" * size)  # same size, wrong bytes
    faults.truncate_ct_file(site.root, 200, TARGET_WEIGHTS, 100)
    served = site.hub.bytes_served
    document = recover(site)
    assert "1 file(s) from the hub" in check_of(document, "model")["action"]
    assert site.hub.bytes_served == served + size
    assert site.shm_digests("target") == site.hub_digests(TARGET_REPO)
    assert site.shm_digests("draft") == site.hub_digests(DRAFT_REPO)
    assert_healthy(site)


def test_8_driver_mismatch_is_named_with_both_versions_and_not_fixed(site):
    faults.set_ct_driver_version(site.root, 200, "550.54.14")
    try:
        code, document = site.ddops("recover", "--ct", "200")
        assert code == 1
        assert check_of(document, "cuda") == {
            **check_of(document, "cuda"),
            "status": "failed",
            "evidence": "CT 200: driver userspace 550.54.14 does not match the host kernel "
            "module 550.90.07: install the 550.90.07 userspace in the CT (NVIDIA-Linux-x86_64-"
            "550.90.07.run --no-kernel-module), or libnvidia-container-tools on the host: ddops "
            "then mounts the host's own userspace into the CT at each start",
        }
        assert statuses(document)["model"] == "skipped"
    finally:
        faults.set_ct_driver_version(site.root, 200, "550.90.07")
    assert_healthy(site)


def test_9_two_concurrent_recovers_both_end_healthy(site):
    site.t.run(["pct", "stop", "200"]).check("stop")
    argv = [sys.executable, "-m", "ops.cli", "-i", str(site.inventory), "--json"]
    runs = [
        subprocess.Popen([*argv, "recover", "--ct", "200"], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    documents = []
    for run in runs:
        out, _ = run.communicate(timeout=600)
        assert run.returncode == 0, out
        documents.append(json.loads(out))
    # One repaired the CT; the other waited for the host lock and found nothing to do.
    assert sorted(bool(changed(d)) for d in documents) == [False, True]
    assert_healthy(site)


def test_recovery_at_boot_needs_no_person(site, capsys):
    for unit in (RECOVER_UNIT, GPU_NODES_UNIT):
        (site.root / "etc/systemd/system/multi-user.target.wants" / unit).symlink_to(f"../{unit}")
    served = site.hub.bytes_served
    start = time.monotonic()
    report = reboot_host(site.root, uvm_major=300)
    assert report.units == ["ddops-gpu-nodes", "ddops-recover"]
    assert_healthy(site)
    code, document = site.ddops("health", "--ct", "200")
    last = document["cts"][0]["last_recover"]  # what the boot unit did, as health shows it
    assert (last["trigger"], last["ok"], last["failed"]) == ("boot", True, None)
    repaired = {r["key"]: r for r in last["repaired"]}
    assert {"ct-config", "model", "service"} <= set(repaired)
    assert "300" in repaired["ct-config"]["done"] or "300" in repaired["ct-config"]["found"]
    assert "0 file(s) from the hub" in repaired["model"]["done"]
    with capsys.disabled():
        print(f"\nsim reboot -> healthy engine (tiny model): {time.monotonic() - start:.1f}s")
    assert site.hub.bytes_served == served
