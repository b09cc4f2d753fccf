"""`ddops sim init|reboot|destroy` and the sim host's tools (no containers started: fast).

python -m pytest -q tests/sim/test_cli.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine.machine_state import GPU_QUERY, parse_gpus
from ops.chain.install import install_host_ddops
from ops.cli import cli
from ops.host.transport import LocalTransport
from ops.sim import faults, pveconf


def ddops(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "pve"
    rc, _ = ddops(
        "sim", "init", str(path), "--gpus", "2", "--containers", "process", "--pve-version", "8.2.4"
    )
    assert rc == 0
    return path


def test_init_reports_the_host_and_is_a_no_op_the_second_time(tmp_path: Path):
    path = tmp_path / "pve"
    rc, out = ddops(
        "--json", "sim", "init", str(path), "--uvm-major", "300", "--containers", "process"
    )
    created = json.loads(out)
    assert (rc, created["changed"], created["uvm_major"], created["containers"]) == (
        0,
        True,
        300,
        "process",
    )
    rc, out = ddops("sim", "init", str(path))
    assert (rc, out) == (0, f"{path}: already a simulated host: unchanged\n")


def test_init_refuses_to_clobber_a_directory_that_is_not_a_sim(tmp_path: Path):
    (tmp_path / "precious").write_text("keep me")
    rc, out = ddops("sim", "init", str(tmp_path))
    assert rc == 1
    assert f"Error: {tmp_path}: exists and is not a simulated host: refusing to clobber it" in out
    assert (tmp_path / "precious").read_text() == "keep me"


MACHINE_QUERY = ["nvidia-smi", f"--query-gpu={','.join(GPU_QUERY)}"]


def test_host_tools_read_the_simulated_kernel(root: Path):
    t = LocalTransport(sysroot=str(root))
    assert "511 nvidia-uvm" in t.read_text("/proc/devices")
    assert "Kernel Module  550.90.07" in t.read_text("/proc/driver/nvidia/version")
    assert t.run(["pveversion"]).stdout.startswith("pve-manager/8.2.4/")
    query = ["nvidia-smi", "--query-gpu=index,driver_version,memory.total", "--format=csv,noheader"]
    assert t.run(query).stdout == "0, 550.90.07, 97887 MiB\n1, 550.90.07, 97887 MiB\n"
    # What the bench records (engine/machine_state.py), units off: an idle card, no processes.
    clocks = t.run([*MACHINE_QUERY, "--format=csv,noheader,nounits"]).stdout.splitlines()
    assert [parse_gpus(line)[0]["sm_max_mhz"] for line in clocks] == [3090.0, 3090.0]
    apps = ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv"]
    assert t.run(apps).stdout == "pid, process_name, used_memory\n"
    assert [line.split()[0] for line in t.run(["lsmod"]).stdout.splitlines()[1:]] == [
        "nvidia_uvm",
        "nvidia",
    ]
    faults.unload_module(root, "nvidia")
    smi = t.run(["nvidia-smi", "-L"])
    assert smi.rc == 9 and "couldn't communicate with the NVIDIA driver" in smi.stdout
    assert "nvidia" not in t.read_text("/proc/devices")
    assert not t.exists("/proc/driver/nvidia/version")


def test_reboot_changes_the_uvm_major_and_loads_modules_from_modules_load_d(root: Path):
    rc, out = ddops("--json", "sim", "reboot", str(root))
    first = json.loads(out)
    assert rc == 0 and first["uvm_major"] != 511 and 234 <= first["uvm_major"] <= 511
    assert first["modules"] == ["nvidia"]
    (root / "etc/modules-load.d/nvidia.conf").write_text("# GPU\nnvidia\nnvidia-uvm\n")
    rc, out = ddops("sim", "reboot", str(root), "--uvm-major", "509")
    assert rc == 0 and f"rebooted: uvm major {first['uvm_major']} -> 509" in out
    t = LocalTransport(sysroot=str(root))
    assert "509 nvidia-uvm" in t.read_text("/proc/devices")
    assert not t.exists("/dev/nvidia-uvm")  # the module loaded, its nodes did not appear


def test_pct_create_set_config_and_its_refusals(root: Path):
    t = LocalTransport(sysroot=str(root))
    t.run(["pct", "create", "201", "local:vztmpl/debian.tar.zst", "--hostname", "llm"]).check(
        "create"
    )
    again = t.run(["pct", "create", "201", "local:vztmpl/debian.tar.zst"])
    assert (again.rc, again.stderr.strip()) == (
        255,
        "unable to create CT 201 - CT 201 already exists on node 'pve'",
    )
    t.run(["pct", "set", "201", "--onboot", "1", "--dev0", "/dev/nvidia0,gid=44"]).check("set")
    raw = t.run(["pct", "set", "201", "--lxc.cgroup2.devices.allow", "c 195:* rwm"])
    assert raw.rc == 255 and raw.stderr.startswith("Unknown option: lxc.cgroup2.devices.allow")
    config = t.run(["pct", "config", "201"]).stdout.splitlines()
    assert "dev0: /dev/nvidia0,gid=44" in config and "onboot: 1" in config
    assert t.run(["pct", "list"]).stdout.splitlines()[1].split() == ["201", "stopped", "llm"]
    t.run(["pct", "destroy", "201"]).check("destroy")
    assert not t.exists("/etc/pve/lxc/201.conf")


def test_destroy_removes_the_host(root: Path):
    rc, out = ddops("sim", "destroy", str(root))
    assert (rc, root.exists()) == (0, False)
    assert out == f"{root}: simulated host destroyed (CTs: none)\n"


def test_pveconf_set_keys_keeps_comments_and_sections():
    text = "#desc\narch: amd64\nlock: backup\nlxc.mount.entry: a b\n\n[snap1]\narch: amd64\n"
    edited = pveconf.set_keys(text, {"lock": None, "onboot": "1"})
    assert edited == "#desc\narch: amd64\nonboot: 1\nlxc.mount.entry: a b\n\n[snap1]\narch: amd64\n"
    assert pveconf.dev_entries("dev0: /dev/nvidia-uvm,mode=0660,gid=44\n") == [
        pveconf.DevEntry("dev0", "/dev/nvidia-uvm", 0o660, None, 44)
    ]


def test_reboot_runs_enabled_units_with_sim_commands_only(root: Path):
    units = root / "etc/systemd/system"
    (units / "multi-user.target.wants").mkdir()
    for name, exec_start in {
        "ddops-recover": "ExecStart=-/usr/local/bin/ddops --version\nExecStart=/usr/bin/nvidia-modprobe -u -c=0",
        "not-sim": "ExecStart=/usr/bin/touch /tmp/ddops-sim-must-not-run",
        "disabled": "ExecStart=/usr/bin/nvidia-modprobe -u",
    }.items():
        (units / f"{name}.service").write_text(f"[Service]\nType=oneshot\n{exec_start}\n")
        if name != "disabled":
            (units / "multi-user.target.wants" / f"{name}.service").symlink_to(
                units / f"{name}.service"
            )
    rc, out = ddops("--json", "sim", "reboot", str(root), "--uvm-major", "240")
    log = (root / "var/log/ddops-sim.log").read_text()
    assert "boot: ddops-recover.service: skipped (not a command the sim host runs): " in log
    assert "-/usr/local/bin/ddops --version" in log  # no ddops on the host: nothing to run
    install_host_ddops(LocalTransport(sysroot=str(root)), dry_run=False)
    rc, out = ddops("--json", "sim", "reboot", str(root), "--uvm-major", "240")
    assert rc == 0 and json.loads(out)["units"] == ["ddops-recover"]
    assert LocalTransport(sysroot=str(root)).exists("/dev/nvidia-uvm")
    log = (root / "var/log/ddops-sim.log").read_text()
    assert "boot: ddops-recover.service: -/usr/local/bin/ddops --version -> exit 0" in log
    assert (
        "boot: not-sim.service: skipped" in log and not Path("/tmp/ddops-sim-must-not-run").exists()
    )


def test_init_defaults_to_pve_9_2_and_older_releases_keep_pve_8s_host(tmp_path: Path):
    rc, _ = ddops("sim", "init", str(tmp_path / "nine"), "--containers", "process")
    nine = LocalTransport(sysroot=str(tmp_path / "nine"))
    assert rc == 0
    assert nine.run(["pveversion"]).stdout == (
        "pve-manager/9.2.11/faa83925c9641325 (running kernel: 7.0.14-8-pve)\n"
    )
    verbose = nine.run(["pveversion", "-v"]).stdout.splitlines()
    assert "lxc-pve: 6.0.5-1" in verbose and "pve-container: 6.0.6" in verbose
    assert nine.run(["uname", "-r"]).stdout == "7.0.14-8-pve\n"
    assert nine.read_text("/proc/driver/nvidia/version").startswith(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  590.48.01  "
    )
    query = ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"]
    assert nine.run(query).stdout == "NVIDIA RTX PRO 6000 Blackwell Workstation Edition, 12.0\n"
    nine.run(["pct", "create", "201", "local:vztmpl/debian-13.tar.zst"]).check("create")
    nine.run(["pct", "create", "202", "local:vztmpl/x.tar.zst", "--unprivileged", "0"]).check("")
    assert "unprivileged: 1" in nine.run(["pct", "config", "201"]).stdout.splitlines()
    assert "unprivileged: 0" in nine.run(["pct", "config", "202"]).stdout.splitlines()

    rc, _ = ddops(
        "sim", "init", str(tmp_path / "eight"), "--pve-version", "8.4.1", "--containers", "process"
    )
    eight = LocalTransport(sysroot=str(tmp_path / "eight"))
    assert rc == 0 and eight.run(["uname", "-r"]).stdout == "6.8.12-1-pve\n"
    assert "x86_64 Kernel Module  550.90.07" in eight.read_text("/proc/driver/nvidia/version")
    eight.run(["pct", "create", "201", "local:vztmpl/debian-12.tar.zst"]).check("create")
    assert "unprivileged" not in eight.run(["pct", "config", "201"]).stdout  # privileged


@pytest.mark.parametrize(
    "args, said",
    [
        (
            ["init", "{p}", "--pve-version", "9.x"],
            "--pve-version '9.x': expected MAJOR.MINOR.PATCH",
        ),
        (["init", "{p}", "--pve-version", "6.4.1"], "the sim plays Proxmox VE 7, 8 and 9"),
        (["init", "{p}", "--driver", "latest"], "--driver 'latest': expected a version like"),
        (["upgrade", "{root}"], "give one of --kernel VERSION or --driver VERSION"),
        (["upgrade", "{root}", "--kernel", "7.1"], "--kernel '7.1': expected a version like"),
    ],
)
def test_bad_sim_input_is_one_line_and_exit_2(root: Path, tmp_path: Path, args, said):
    argv = [a.format(p=tmp_path / "new", root=root) for a in args]
    result = CliRunner().invoke(cli, ["sim", *argv])
    assert result.exit_code == 2
    assert said in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()
