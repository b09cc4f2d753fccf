"""ops/host/gpu.py: parsers on real-world-shaped host text, and the readers on a tmp sysroot.

Run: python -m pytest -q tests/ops/host/test_gpu.py
"""

from __future__ import annotations

import os
import stat

import pytest

from ops.errors import DdopsError
from ops.host import gpu
from ops.host.gpu import DeviceNode, NvidiaMajors
from ops.host.transport import LocalTransport

# A Proxmox host with a recent driver: uvm got major 509 at this boot, caps 237.
PROC_DEVICES = """\
Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
  5 /dev/tty
 10 misc
 13 input
 89 i2c
128 ptm
136 pts
195 nvidia-frontend
202 cpu/msr
226 drm
234 nvidia-nvswitch
235 nvidia-nvlink
236 nvidia-caps-imex-channels
237 nvidia-caps
239 hidraw
509 nvidia-uvm
510 aux
511 cec

Block devices:
  7 loop
  8 sd
 65 sd
253 device-mapper
259 blkext
"""

# `stat -c '%F %t %T %n'` on the same host: %t/%T are hex (0xc3 = 195, 0x1fd = 509, 0xed = 237).
STAT_NODES = """\
character special file c3 0 /dev/nvidia0
character special file c3 1 /dev/nvidia1
character special file c3 ff /dev/nvidiactl
character special file c3 fe /dev/nvidia-modeset
character special file 1fd 0 /dev/nvidia-uvm
character special file 1fd 1 /dev/nvidia-uvm-tools
directory 0 0 /dev/nvidia-caps
character special file ed 1 /dev/nvidia-caps/nvidia-cap1
character special file ed 2 /dev/nvidia-caps/nvidia-cap2
"""

PROC_MODULES = """\
nvidia_uvm 1794048 0 - Live 0x0000000000000000 (POE)
nvidia_drm 122880 0 - Live 0x0000000000000000 (POE)
nvidia_modeset 1564672 1 nvidia_drm, Live 0x0000000000000000 (POE)
nvidia 60698624 2 nvidia_uvm,nvidia_modeset, Live 0x0000000000000000 (POE)
video 73728 1 nvidia_modeset, Live 0x0000000000000000
overlay 196608 3 - Live 0x0000000000000000
"""

DRIVER_PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC 2024\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14) \n"
)
DRIVER_OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.20  Release Build  "
    "(dvs-builder@U16-I3-B17-1-1)  Fri Apr 18 22:03:50 UTC 2025\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
)

# Stands in for nvidia-modprobe: `-u -c=0` creates the uvm nodes with the current major.
FAKE_NVIDIA_MODPROBE = """#!/bin/sh
root="$(dirname "$0")/../.."
[ "$*" = "-u -c=0" ] || { echo "unexpected: $*" >&2; exit 2; }
mknod "$root/dev/nvidia-uvm" c 509 0 && mknod "$root/dev/nvidia-uvm-tools" c 509 1
"""


# -- parsers -----------------------------------------------------------------------------------
def test_majors_from_proc_devices():
    assert gpu.nvidia_majors(PROC_DEVICES) == NvidiaMajors(nvidia=195, uvm=509, caps=237)
    char = gpu.parse_char_majors(PROC_DEVICES)
    assert char["/dev/vc/0"] == 4 and char["nvidia-caps-imex-channels"] == 236
    assert "loop" not in char and "device-mapper" not in char  # block devices are not chars


def test_majors_with_an_old_driver_and_with_none():
    old = "Character devices:\n  1 mem\n195 nvidia\n244 nvidia-uvm\n\nBlock devices:\n  8 sd\n"
    assert gpu.nvidia_majors(old) == NvidiaMajors(nvidia=195, uvm=244, caps=None)
    assert gpu.nvidia_majors("Character devices:\n  1 mem\n") == NvidiaMajors(None, None, None)


def test_stat_nodes_are_read_as_hex():
    nodes = {n.path: n for n in gpu.parse_stat_nodes(STAT_NODES)}
    assert nodes["/dev/nvidiactl"] == DeviceNode("/dev/nvidiactl", "char", 195, 255)
    assert nodes["/dev/nvidia-uvm-tools"] == DeviceNode("/dev/nvidia-uvm-tools", "char", 509, 1)
    assert nodes["/dev/nvidia-caps/nvidia-cap2"].major == 237
    assert nodes["/dev/nvidia-caps"].kind == "dir"
    assert len(nodes) == 9


@pytest.mark.parametrize(
    ("text", "version"),
    [
        (DRIVER_PROPRIETARY, "550.90.07"),
        (DRIVER_OPEN, "570.133.20"),
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.256.02  Thu May  2 2024\n",
            "470.256.02",
        ),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  560.35.03  Release Build\n",
            "560.35.03",
        ),
        ("GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n", None),
    ],
)
def test_driver_version(text, version):
    assert gpu.parse_driver_version(text) == version


def test_proc_modules():
    modules = gpu.parse_proc_modules(PROC_MODULES)
    assert modules["nvidia_uvm"] == "Live" and modules["overlay"] == "Live"
    assert set(modules) == {
        "nvidia_uvm",
        "nvidia_drm",
        "nvidia_modeset",
        "nvidia",
        "video",
        "overlay",
    }


# -- readers on a simulated host ---------------------------------------------------------------
@pytest.fixture
def host(tmp_path):
    """A tmp sysroot shaped like a host just after a reboot: modules loaded, no uvm nodes yet."""
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / "proc/devices").write_text(PROC_DEVICES)
    (tmp_path / "proc/modules").write_text(PROC_MODULES)
    (tmp_path / "proc/driver/nvidia/version").write_text(DRIVER_PROPRIETARY)
    (tmp_path / "dev/nvidia-caps").mkdir(parents=True)
    (tmp_path / "dev/null-ish").write_text("")  # not an nvidia node: must not be listed
    try:
        for name, minor in [("nvidia0", 0), ("nvidiactl", 255), ("nvidia-caps/nvidia-cap1", 1)]:
            major = 237 if "cap" in name else 195
            os.mknod(tmp_path / "dev" / name, stat.S_IFCHR | 0o666, os.makedev(major, minor))
    except PermissionError:
        pytest.skip("mknod needs root (CAP_MKNOD)")
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/nvidia-modprobe").write_text(FAKE_NVIDIA_MODPROBE)
    (tmp_path / "usr/bin/nvidia-modprobe").chmod(0o755)
    return tmp_path


def test_gpu_facts_then_the_uvm_remedy(host):
    t = LocalTransport(sysroot=str(host))
    facts = gpu.gpu_facts(t)
    assert facts.majors == NvidiaMajors(195, 509, 237)
    assert facts.driver_version == "550.90.07"
    assert set(facts.modules) == {"nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm"}
    assert [n.path for n in facts.nodes] == [
        "/dev/nvidia-caps",
        "/dev/nvidia-caps/nvidia-cap1",
        "/dev/nvidia0",
        "/dev/nvidiactl",
    ]
    assert facts.node("/dev/nvidiactl") == DeviceNode("/dev/nvidiactl", "char", 195, 255)
    assert facts.node("/dev/nvidia-uvm") is None  # the incident: module loaded, node absent
    assert facts.gpu_paths == ["/dev/nvidia0"]

    gpu.create_uvm_nodes(t)
    after = gpu.gpu_facts(t)
    assert after.node("/dev/nvidia-uvm") == DeviceNode("/dev/nvidia-uvm", "char", 509, 0)
    assert after.node("/dev/nvidia-uvm-tools").minor == 1
    with pytest.raises(DdopsError, match="nvidia-modprobe -u -c=0` exited 1"):
        gpu.create_uvm_nodes(t)  # mknod refuses: the nodes exist


def test_a_host_without_the_driver(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "dev").mkdir()
    (tmp_path / "proc/devices").write_text("Character devices:\n  1 mem\n\nBlock devices:\n")
    (tmp_path / "proc/modules").write_text("overlay 196608 3 - Live 0x0000000000000000\n")
    facts = gpu.gpu_facts(LocalTransport(sysroot=str(tmp_path)))
    assert facts == gpu.GpuFacts(NvidiaMajors(None, None, None), (), None, {})


# -- the history of NVIDIA majors --------------------------------------------------------------


def test_majors_are_recorded_once_and_kept_across_moves(tmp_path):
    from ops.host.gpu import MAJOR_HISTORY, read_major_history, record_majors, unrecorded_majors
    from ops.host.transport import LocalTransport

    t = LocalTransport(sysroot=str(tmp_path))
    before = {"mem": 1, "nvidia-frontend": 195, "nvidia-caps": 510, "nvidia-uvm": 511}
    assert unrecorded_majors(t, before) == {
        195: "nvidia-frontend",
        510: "nvidia-caps",
        511: "nvidia-uvm",
    }
    assert record_majors(t, before) == {
        195: "nvidia-frontend",
        510: "nvidia-caps",
        511: "nvidia-uvm",
    }
    assert record_majors(t, before) == {}  # nothing new: the file is not rewritten
    assert not (tmp_path / "var/lib/ddops/backups").exists()  # (a rewrite backs the old one up)
    after = {**before, "nvidia-uvm": 509, "nvidia-caps": 508}
    assert record_majors(t, after) == {508: "nvidia-caps", 509: "nvidia-uvm"}
    assert set(read_major_history(t)) == {195, 508, 509, 510, 511}
    assert t.read_text(MAJOR_HISTORY).splitlines()[1:] == [
        "195 nvidia-frontend",
        "508 nvidia-caps",
        "509 nvidia-uvm",
        "510 nvidia-caps",
        "511 nvidia-uvm",
    ]
    assert list((tmp_path / "var/lib/ddops/backups").iterdir())  # the old history backed up


def test_the_history_file_ignores_lines_it_does_not_know():
    from ops.host.gpu import parse_major_history

    text = "# comment\n511 nvidia-uvm\n240 hidraw\nnonsense\n195 nvidia-frontend extra\n"
    assert parse_major_history(text) == {511: "nvidia-uvm"}
