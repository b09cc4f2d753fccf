"""ops/host/pve.py: pct/pveversion parsers on real-shaped output, and the actions against a small
fake `pct` in a tmp sysroot (real messages and exit codes; the full sim lives in ops/sim).

Run: python -m pytest -q tests/ops/host/test_pve.py
"""

from __future__ import annotations

import sys

import pytest

from ops.errors import DdopsError
from ops.host import pve
from ops.host.pve import PveVersion
from ops.host.transport import LocalTransport

# pct as Proxmox behaves for what ddops uses: exit 0, or 255 with pct's own words. State lives
# below the sysroot: etc/pve/lxc/<vmid>.conf, run/<vmid>.running, ct/<vmid>/ (the CT's files);
# every call is appended to pct.log.
FAKE_PCT = """#!{python}
import os, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
argv = sys.argv[1:]
with open(ROOT / "pct.log", "a") as log:
    log.write(" ".join(argv[:2]) + "\\n")


def fail(message):
    print(message, file=sys.stderr)
    sys.exit(255)


action, vmid = argv[0], argv[1]
conf = ROOT / f"etc/pve/lxc/{{vmid}}.conf"
running = ROOT / f"run/{{vmid}}.running"
if not conf.exists():
    fail(f"Configuration file 'nodes/pve1/lxc/{{vmid}}.conf' does not exist")
main = [l for l in conf.read_text().split("\\n[")[0].splitlines() if l and l[0] != "#"]
lock = next((l.split(": ", 1)[1] for l in main if l.startswith("lock: ")), None)
if action == "status":
    print("status: " + ("running" if running.exists() else "stopped"))
elif action == "config":
    print("\\n".join(main))
elif action == "unlock":
    conf.write_text("".join(l + "\\n" for l in main if not l.startswith("lock: ")))
elif lock and action in ("start", "stop", "shutdown"):
    fail(f"CT is locked ({{lock}})")
elif action == "start":
    if running.exists():
        fail(f"CT {{vmid}} already running")
    running.parent.mkdir(exist_ok=True)
    running.touch()
elif not running.exists():
    fail(f"CT {{vmid}} not running")
elif action in ("stop", "shutdown"):
    running.unlink()
elif action == "exec":
    sys.exit(subprocess.run(argv[3:], cwd=ROOT / "ct" / vmid).returncode)
elif action == "push":
    src, dst, perms = ROOT / argv[2].lstrip("/"), ROOT / "ct" / vmid / argv[3].lstrip("/"), argv[5]
    if not src.exists():
        fail(f"failed to open {{argv[2]}} for reading")
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes())
    os.chmod(dst, int(perms, 8))
"""

CT_CONF = """\
#GPU LLM engine
arch: amd64
cores: 8
hostname: llm1
memory: 65536
onboot: 1
ostype: debian
rootfs: local-lvm:vm-200-disk-0,size=64G
dev0: /dev/nvidia0,gid=44
lxc.cgroup2.devices.allow: c 195:* rwm
lxc.cgroup2.devices.allow: c 509:* rwm
lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file

[before-upgrade]
memory: 32768
snaptime: 1717171717
"""


@pytest.fixture
def host(tmp_path):
    """A tmp sysroot with the fake pct and CT 200 (stopped)."""
    sbin = tmp_path / "usr/sbin"
    sbin.mkdir(parents=True)
    (sbin / "pct").write_text(FAKE_PCT.format(python=sys.executable))
    (sbin / "pct").chmod(0o755)
    (tmp_path / "etc/pve/lxc").mkdir(parents=True)
    (tmp_path / "etc/pve/lxc/200.conf").write_text(CT_CONF)
    (tmp_path / "ct/200").mkdir(parents=True)
    return tmp_path


@pytest.fixture
def t(host):
    return LocalTransport(sysroot=str(host))


def pct_calls(host) -> list[str]:
    log = host / "pct.log"
    return log.read_text().splitlines() if log.exists() else []


def lock_ct(host, lock: str) -> None:
    conf = host / "etc/pve/lxc/200.conf"
    conf.write_text(f"lock: {lock}\n" + conf.read_text())


# -- parsers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("good", [100, "200", "999999999", 4242])
def test_valid_vmids(good):
    assert pve.validate_vmid(good) == str(good)


@pytest.mark.parametrize("bad", [99, "0200x", "200; reboot", "-200", "1000000000", "", "²००"])
def test_invalid_vmids_never_reach_a_command(bad, t, host):
    with pytest.raises(DdopsError, match="a vmid is a number from 100 to 999999999"):
        pve.ct_status(t, bad)
    assert pct_calls(host) == []


def test_pct_config_keeps_order_repeats_and_multiline_descriptions():
    cfg = pve.parse_pct_config(
        "arch: amd64\n"
        "description: GPU box\n  second line\n"
        "lxc.cgroup2.devices.allow: c 195:* rwm\n"
        "lxc.cgroup2.devices.allow: c 509:* rwm\n"
        "memory: 65536\n"
    )
    assert cfg["memory"] == "65536" and cfg.get("lock") is None and "arch" in cfg
    assert cfg["description"] == "GPU box\n  second line"
    assert cfg.all("lxc.cgroup2.devices.allow") == ["c 195:* rwm", "c 509:* rwm"]
    with pytest.raises(KeyError):
        cfg["lock"]


@pytest.mark.parametrize(
    ("text", "release", "kernel", "dev_entries"),
    [
        (
            "pve-manager/8.2.4/faa83925c9641325 (running kernel: 6.8.12-1-pve)\n",
            (8, 2, 4),
            "6.8.12-1-pve",
            True,
        ),
        (
            "pve-manager/8.1.3/b46aac3b42da5d15 (running kernel: 6.5.11-4-pve)",
            (8, 1, 3),
            "6.5.11-4-pve",
            True,
        ),
        (
            "pve-manager/8.0.4/d258a813cfa6b390 (running kernel: 6.2.16-3-pve)",
            (8, 0, 4),
            "6.2.16-3-pve",
            False,
        ),
        (
            "pve-manager/7.4-3/9002ab8a (running kernel: 5.15.102-1-pve)",
            (7, 4, 3),
            "5.15.102-1-pve",
            False,
        ),
        ("pve-manager/9.0.3/025864202ebb6109", (9, 0, 3), None, True),
    ],
)
def test_pveversion_parses_and_gates_dev_entries(text, release, kernel, dev_entries):
    version = pve.parse_pveversion(text)
    assert ((version.major, version.minor, version.patch), version.kernel) == (release, kernel)
    assert str(version) == ".".join(map(str, release))
    assert pve.supports_dev_entries(version) is dev_entries


def test_pveversion_errors(tmp_path):
    with pytest.raises(DdopsError, match="unrecognised output"):
        pve.parse_pveversion("pve-manager: unknown\n")
    with pytest.raises(DdopsError, match="not a Proxmox VE host"):
        pve.pve_version(LocalTransport(sysroot=str(tmp_path), label="bare"))
    (tmp_path / "usr/bin").mkdir(parents=True)
    tool = tmp_path / "usr/bin/pveversion"
    tool.write_text("#!/bin/sh\necho 'pve-manager/8.2.4/faa83925c9641325 (running kernel: k1)'\n")
    tool.chmod(0o755)
    assert pve.pve_version(LocalTransport(sysroot=str(tmp_path))) == PveVersion(8, 2, 4)


# -- facts and actions through the fake pct ----------------------------------------------------
def test_status_config_and_lock(t, host):
    assert pve.ct_status(t, 200) == "stopped"
    assert pve.ct_status(t, 201) is None
    cfg = pve.ct_config(t, 200)
    assert cfg["memory"] == "65536"  # the main section, not the snapshot's 32768
    assert cfg.all("lxc.cgroup2.devices.allow") == ["c 195:* rwm", "c 509:* rwm"]
    assert "snaptime" not in cfg
    assert pve.ct_lock(t, 200) is None
    lock_ct(host, "backup")
    assert pve.ct_lock(t, 200) == "backup"
    with pytest.raises(DdopsError, match=r"CT 201: does not exist \(no /etc/pve/lxc/201.conf\)"):
        pve.ct_config(t, 201)


def test_start_stop_shutdown_act_only_when_needed(t, host):
    assert pve.ct_start(t, 200) is True
    assert pve.ct_status(t, 200) == "running"
    assert pve.ct_start(t, 200) is False  # pct start would fail "already running"
    assert pve.ct_shutdown(t, 200, timeout_s=5) is True
    assert pve.ct_stop(t, 200) is False
    assert pve.ct_shutdown(t, 200) is False
    assert pve.ct_start(t, "200") is True and pve.ct_stop(t, 200) is True
    assert [c for c in pct_calls(host) if not c.startswith("status")] == [
        "start 200",
        "shutdown 200",
        "start 200",
        "stop 200",
    ]
    with pytest.raises(DdopsError, match="CT 201: does not exist"):
        pve.ct_start(t, 201)


def test_a_locked_ct_is_named_with_its_lock_then_unlocked(t, host):
    lock_ct(host, "backup")
    with pytest.raises(DdopsError, match=r"CT 200: locked \(backup\): `pct start` refused") as e:
        pve.ct_start(t, 200)
    assert "pct unlock 200" in str(e.value)
    assert pve.ct_unlock(t, 200) is True
    assert pve.ct_unlock(t, 200) is False
    assert pve.ct_start(t, 200) is True


def test_exec_returns_the_commands_result_and_passes_env_on_stdin(t, host):
    pve.ct_start(t, 200)
    r = pve.ct_exec(
        t, 200, ["sh", "-c", 'echo "$HF_TOKEN"; cat; exit 7'], env={"HF_TOKEN": "hf_x"}, input="in"
    )
    assert (r.rc, r.stdout) == (7, "hf_x\nin")
    assert r.argv == ("pct", "exec", "200", "--", "sh", "-c", 'echo "$HF_TOKEN"; cat; exit 7')
    assert "hf_x" not in " ".join(r.argv)
    assert pve.ct_exec(t, 200, ["pwd"]).stdout == f"{host}/ct/200\n"  # ran "inside" the CT
    pve.ct_stop(t, 200)
    with pytest.raises(
        DdopsError, match="CT 200: `pct exec 200 -- true` exited 255: CT 200 not running"
    ):
        pve.ct_exec(t, 200, ["true"], env={"HF_TOKEN": "hf_x"})


def test_push_copies_with_perms(t, host):
    t.write_file("/var/lib/ddops/probe.sh", "#!/bin/sh\n")
    with pytest.raises(DdopsError, match="CT 200 not running"):
        pve.ct_push(t, 200, "/var/lib/ddops/probe.sh", "/usr/local/bin/probe")
    pve.ct_start(t, 200)
    pve.ct_push(t, 200, "/var/lib/ddops/probe.sh", "/usr/local/bin/probe", perms=0o755)
    pushed = host / "ct/200/usr/local/bin/probe"
    assert pushed.read_text() == "#!/bin/sh\n" and pushed.stat().st_mode & 0o777 == 0o755
    with pytest.raises(DdopsError, match="failed to open /missing for reading"):
        pve.ct_push(t, 200, "/missing", "/x")
    with pytest.raises(DdopsError, match="not an absolute host path"):
        pve.ct_push(t, 200, "relative", "/x")


@pytest.mark.parametrize(
    ("version", "hotplugs"), [("9.0.3", True), ("9.2.11", True), ("8.4.1", False)]
)
def test_dev_hotplug_is_pve_9s(version, hotplugs):
    text = f"pve-manager/{version}/025864202ebb6109"
    assert pve.hotplugs_dev_entries(pve.parse_pveversion(text)) is hotplugs


def test_ct_set_refuses_an_option_that_is_no_pct_option_before_running_pct(t, host):
    with pytest.raises(DdopsError, match="not a pct option name"):
        pve.ct_set(t, 200, {"dev0 --delete": "x"})
    assert pct_calls(host) == []
