"""The CUDA probe (ops/agents/probe.py) against a directory playing a container's root.

    python -m pytest -q tests/ops/agents/test_probe.py

Nodes are real character devices with no driver behind them (open -> ENXIO, "ok"), so these
tests need root for mknod (except the placeholder one); EPERM from a device cgroup is covered in tests/integration/test_sim_lxc.py.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from ops.agents import probe

NODES = {
    "nvidiactl": (195, 255),
    "nvidia0": (195, 0),
    "nvidia-uvm": (509, 0),
    "nvidia-uvm-tools": (509, 1),
}


@pytest.fixture
def ct_root(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    (tmp_path / "dev").mkdir()
    for name, (major, minor) in NODES.items():
        os.mknod(tmp_path / "dev" / name, stat.S_IFCHR | 0o666, os.makedev(major, minor))
    describe_userspace(tmp_path, userspace="550.90.07", module="550.90.07")
    return tmp_path


def describe_userspace(root: Path, *, userspace: str, module: str) -> None:
    path = root / probe.SIM_USERSPACE
    path.parent.mkdir(parents=True, exist_ok=True)
    versions = {"userspace_version": userspace, "kernel_module_version": module}
    path.write_text(json.dumps({"node": "pve", "gpus": 1, **versions}))


def test_nodes_without_a_driver_are_ok_and_simulated_cuinit_succeeds(ct_root: Path):
    report = probe.probe(str(ct_root))
    assert report["verdict"] == "ok"
    assert {n["node"]: n["device"] for n in report["nodes"]}["/dev/nvidia-uvm"] == "509:0"
    assert report["cuda"] == {"source": "ddops-sim", "cuInit": 0, "cuda_driver_version": 12040}
    assert report["userspace_driver_version"] == "550.90.07"


def test_a_missing_uvm_node_is_named_and_cuinit_fails_999(ct_root: Path):
    (ct_root / "dev/nvidia-uvm").unlink()
    report = probe.probe(str(ct_root))
    assert (report["verdict"], report["reason"]) == ("missing", "/dev/nvidia-uvm: missing")
    assert report["cuda"]["cuInit"] == 999


def test_an_empty_placeholder_left_by_an_optional_mount_counts_as_missing(ct_root: Path):
    (ct_root / "dev/nvidia-uvm").unlink()
    (ct_root / "dev/nvidia-uvm").write_text("")
    report = probe.probe(str(ct_root))
    assert report["verdict"] == "missing"
    assert report["reason"].startswith("/dev/nvidia-uvm: not a device node")


def test_a_userspace_older_than_the_module_is_a_version_mismatch(ct_root: Path):
    describe_userspace(ct_root, userspace="550.54.14", module="550.90.07")
    report = probe.probe(str(ct_root))
    assert (report["verdict"], report["cuda"]["cuInit"]) == ("mismatch", 803)
    assert report["userspace_driver_version"] == "550.54.14"


def test_without_any_libcuda_the_probe_says_so(ct_root: Path):
    (ct_root / probe.SIM_USERSPACE).unlink()
    report = probe.probe(str(ct_root))
    assert (report["verdict"], report["reason"]) == ("error", "no libcuda in the container")
    assert report["cuda"] is None and report["userspace_driver_version"] is None


def test_main_prints_json_or_one_line_per_node_and_exits_1_on_failure(ct_root, monkeypatch, capsys):
    monkeypatch.setenv("DDOPS_CT_ROOT", str(ct_root))
    assert probe.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "ok"
    (ct_root / "dev/nvidiactl").unlink()
    assert probe.main([]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "missing  /dev/nvidiactl: missing"
    assert lines[-1] == "missing: /dev/nvidiactl: missing"


def test_sim_placeholder_files_count_as_nodes_only_below_a_sim_ct_root(tmp_path: Path):
    (tmp_path / "dev").mkdir()
    for name, (major, minor) in NODES.items():
        (tmp_path / "dev" / name).write_text(f"c {major}:{minor}\n")
    describe_userspace(tmp_path, userspace="550.90.07", module="550.90.07")
    report = probe.probe(str(tmp_path))
    assert report["verdict"] == "ok"
    assert {n["node"]: n["device"] for n in report["nodes"]}["/dev/nvidia-uvm"] == "509:0"
    as_root = probe.check_node(str(tmp_path / "dev/nvidia-uvm"))  # in a real CT: not a node
    assert as_root["verdict"] == "missing"


def test_the_userspace_version_comes_from_library_file_names(tmp_path: Path):
    libs = tmp_path / "usr/lib/x86_64-linux-gnu"
    libs.mkdir(parents=True)
    (libs / "libnvidia-ml.so.550.54.14").write_bytes(b"")
    assert probe.userspace_version(str(tmp_path)) == "550.54.14"
