#!/usr/bin/env python3
"""The CUDA probe: run inside a container to name why CUDA cannot start. Stdlib only.

    pct push 200 ops/agents/probe.py /tmp/ddops-probe.py
    pct exec 200 -- python3 /tmp/ddops-probe.py --json

1. Opens every /dev/nvidia* node ddops expects (nvidiactl, nvidia-uvm, nvidia-uvm-tools,
   nvidia0..N) and names each failure: missing node (or an empty placeholder file left by an
   `optional,create=file` mount whose host node was absent), EPERM = blocked by the device
   cgroup, ENXIO/ENODEV = allowed but no driver behind the node (a fake GPU: counted ok).
2. Where a real libcuda exists, calls cuInit(0) and cuDriverGetVersion through ctypes.
   In the ddops sim (its description wins when present: a sim host may sit on a real GPU
   machine), /etc/ddops-sim/nvidia.json describes the CT's driver userspace and cuInit is
   simulated from it: 0 when nvidiactl, a GPU node and nvidia-uvm open, 999
   (CUDA_ERROR_UNKNOWN, what a blocked uvm gives) when uvm does not, 100 (NO_DEVICE) without
   nvidiactl or GPU nodes, 803 (SYSTEM_DRIVER_MISMATCH) when userspace and module differ.
3. Reports the container's userspace driver version (libcuda.so.X / libnvidia-ml.so.X file
   names, else the sim's description) so the caller compares it with the host's
   /proc/driver/nvidia/version.

Exit code 0 when the overall verdict is "ok", else 1. DDOPS_CT_ROOT (the sim's process mode)
names the directory playing the container's root.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import glob
import json
import os
import re
import stat
import sys

REQUIRED_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib", "lib/x86_64-linux-gnu")
SIM_USERSPACE = "etc/ddops-sim/nvidia.json"
CUDA_SUCCESS, CUDA_NO_DEVICE, CUDA_MISMATCH, CUDA_UNKNOWN = 0, 100, 803, 999


def check_node(path: str, sim_placeholders: bool = False) -> dict:
    """Open one node; the verdict ("ok" | "missing" | "blocked" | "error") and why.

    `sim_placeholders`: the sim's process mode without root stands in for a node with a small
    file "c MAJOR:MINOR"; such a file counts as a node there (nothing else can be checked).
    """
    name = "/dev/" + os.path.basename(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return {"node": name, "verdict": "missing", "reason": f"{name}: missing"}
    if not stat.S_ISCHR(st.st_mode):
        placeholder = _sim_placeholder(path) if sim_placeholders else None
        if placeholder:
            return {
                "node": name,
                "device": placeholder,
                "verdict": "ok",
                "reason": "sim placeholder node",
            }
        reason = (
            f"{name}: not a device node (placeholder left by an optional mount: host node absent)"
        )
        return {"node": name, "verdict": "missing", "reason": reason}
    numbers = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    try:
        os.close(os.open(path, os.O_RDWR))
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.ENODEV):
            return {
                "node": name,
                "device": numbers,
                "verdict": "ok",
                "reason": "allowed (no driver behind the node)",
            }
        if exc.errno == errno.EPERM:
            reason = f"{name}: blocked by the device cgroup (EPERM)"
            return {"node": name, "device": numbers, "verdict": "blocked", "reason": reason}
        reason = f"{name}: {errno.errorcode.get(exc.errno, exc.errno)} {exc.strerror}"
        return {"node": name, "device": numbers, "verdict": "error", "reason": reason}
    return {"node": name, "device": numbers, "verdict": "ok", "reason": "opened"}


def _sim_placeholder(path: str) -> str | None:
    """ "MAJOR:MINOR" from a sim placeholder file, else None."""
    with open(path, "rb") as f:
        match = re.fullmatch(rb"c (\d+:\d+)\n", f.read(64))
    return match.group(1).decode() if match else None


def check_nodes(ct_root: str) -> list[dict]:
    dev = os.path.join(ct_root, "dev")
    gpus = sorted(p for p in glob.glob(os.path.join(dev, "nvidia[0-9]*")))
    paths = [os.path.join(dev, n) for n in REQUIRED_NODES] + (
        gpus or [os.path.join(dev, "nvidia0")]
    )
    return [check_node(p, sim_placeholders=ct_root != "/") for p in paths]


def real_cuda() -> dict | None:
    """cuInit + cuDriverGetVersion through a real libcuda; None when there is none."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        rc = lib.cuInit(0)
        version = ctypes.c_int(0)
        lib.cuDriverGetVersion(ctypes.byref(version))
        return {"source": "libcuda", "cuInit": rc, "cuda_driver_version": version.value}
    return None


def simulated_cuda(ct_root: str, nodes: list[dict]) -> dict | None:
    try:
        with open(os.path.join(ct_root, SIM_USERSPACE)) as f:
            userspace = json.load(f)
    except FileNotFoundError:
        return None
    ok = {n["node"] for n in nodes if n["verdict"] == "ok"}
    if userspace["userspace_version"] != userspace.get("kernel_module_version"):
        rc = CUDA_MISMATCH
    elif "/dev/nvidiactl" not in ok or not any(re.fullmatch(r"/dev/nvidia\d+", n) for n in ok):
        rc = CUDA_NO_DEVICE
    elif "/dev/nvidia-uvm" not in ok:
        rc = CUDA_UNKNOWN
    else:
        rc = CUDA_SUCCESS
    return {"source": "ddops-sim", "cuInit": rc, "cuda_driver_version": 12040}


def userspace_version(ct_root: str) -> str | None:
    """The version in libcuda.so.X / libnvidia-ml.so.X file names, else the sim's description."""
    for lib_dir in LIB_DIRS:
        for lib in ("libcuda.so.", "libnvidia-ml.so."):
            for path in glob.glob(os.path.join(ct_root, lib_dir, f"{lib}*.*")):
                return path.split(lib, 1)[1]
    try:
        with open(os.path.join(ct_root, SIM_USERSPACE)) as f:
            return json.load(f)["userspace_version"]
    except FileNotFoundError:
        return None


def probe(ct_root: str = "/") -> dict:
    """The whole report: per-node verdicts, the cuInit result, the overall verdict and reason."""
    nodes = check_nodes(ct_root)
    # The sim's description wins: on a sim host with a real GPU, the fake nodes' majors are real.
    cuda = simulated_cuda(ct_root, nodes) or (real_cuda() if ct_root == "/" else None)
    failed = [n for n in nodes if n["verdict"] != "ok"]
    if failed:
        verdict, reason = failed[0]["verdict"], failed[0]["reason"]
    elif cuda is None:
        verdict, reason = "error", "no libcuda in the container"
    elif cuda["cuInit"] == CUDA_MISMATCH:
        verdict, reason = "mismatch", "cuInit: 803 driver/library version mismatch"
    elif cuda["cuInit"] != CUDA_SUCCESS:
        verdict, reason = "error", f"cuInit failed with CUDA error {cuda['cuInit']}"
    else:
        verdict, reason = "ok", "every node opens and cuInit succeeds"
    return {
        "verdict": verdict,
        "reason": reason,
        "nodes": nodes,
        "cuda": cuda,
        "userspace_driver_version": userspace_version(ct_root),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Why can CUDA not start in this container?")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args(argv)
    report = probe(os.environ.get("DDOPS_CT_ROOT", "/"))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for node in report["nodes"]:
            print(
                f"{node['verdict']:<8} {node['node']}: {node['reason'].removeprefix(node['node'] + ': ')}"
            )
        print(f"{report['verdict']}: {report['reason']}")
    return 0 if report["verdict"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
