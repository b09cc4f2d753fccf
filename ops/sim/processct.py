"""Containers as plain processes: the sim's fallback without root or without lxc.

No isolation: a CT is a directory PATH/var/lib/ddops-sim/rootfs/<vmid> and `pct exec` runs the
argv on the host with that directory as cwd, `DDOPS_CT_ROOT` pointing at it (the probe checks
/dev nodes below it) and its bin/ first on PATH. An argv element that is an absolute path
existing in the CT (e.g. a file `pct push`ed to /tmp) is mapped into the CT directory. Device
nodes are copied into the CT's dev/ at start, a missing devN node still fails the start, and
dev/shm is emptied at stop, and the processes `pct exec` started there (and their descendants)
are killed. Device
cgroup rules are not enforced (there is no cgroup).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ops.sim.kernel import make_node, node_numbers
from ops.sim.startplan import SHM_TARGET, CtDevice, StartError, StartPlan, mount_options
from ops.sim.state import ROOTFS_DIR, SimState

CT_ROOT_ENV = "DDOPS_CT_ROOT"
SKELETON = ("bin", "dev/shm", "etc", "root", "tmp")
USER_TOOLS = ("useradd", "groupadd", "adduser", "addgroup")


class ProcessContainers:
    """The containers of one sim host as directories; running state kept in the sim state."""

    def __init__(self, root: Path, state: SimState) -> None:
        self.root = root
        self.state = state

    def rootfs(self, vmid: int) -> Path:
        return self.root / ROOTFS_DIR / str(vmid)

    def create(self, vmid: int, unprivileged: bool = False) -> None:
        """The CT's directories (plain processes: no user namespace, `unprivileged` has no
        effect), and user tools that make no user: a plain-process CT shares the machine's
        accounts, so its processes run as whoever runs the sim."""
        for sub in SKELETON:
            (self.rootfs(vmid) / sub).mkdir(parents=True, exist_ok=True)
        for tool in USER_TOOLS:
            stub = self.rootfs(vmid) / "bin" / tool
            stub.write_text(
                f"#!/bin/sh\n# ddops sim, plain-process CT: {tool} makes no user here\n"
            )
            stub.chmod(0o755)

    def is_running(self, vmid: int) -> bool:
        return vmid in self.state.running

    def start(self, vmid: int, plan: StartPlan) -> None:
        self.create(vmid)
        dev = self.rootfs(vmid) / "dev"
        for device in plan.devices:
            make_node(dev / device.name, device.major, device.minor, self.state.device_nodes)
        for entry in plan.mounts:
            self._apply_mount(dev.parent, entry)
        self.state.running.append(vmid)

    def hotplug(self, vmid: int, dev: CtDevice) -> str | None:
        """Attach a devN node to the running CT (PVE 9's hot-plug): made in its /dev now (None:
        attached; a process CT has no devices cgroup to grant it in)."""
        make_node(
            self.rootfs(vmid) / "dev" / dev.name, dev.major, dev.minor, self.state.device_nodes
        )
        return None

    def _apply_mount(self, ct_root: Path, entry: str) -> None:
        """Bind mounts of device nodes become copies of the node; other mounts are not simulated."""
        source, target = entry.split()[:2]
        if target == SHM_TARGET or not target.startswith("dev/"):
            return
        numbers = node_numbers(Path(source))
        if numbers is not None:
            make_node(ct_root / target, *numbers, self.state.device_nodes)
        elif "optional" not in mount_options(entry):
            raise StartError(f"failed to mount {source} onto {target}: No such file or directory")

    def stop(self, vmid: int, *, graceful: bool = False, timeout: int = 60) -> None:
        for pid in ct_processes(self.rootfs(vmid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM if graceful else signal.SIGKILL)
        dev = self.rootfs(vmid) / "dev"
        shutil.rmtree(dev, ignore_errors=True)  # /dev and its /dev/shm tmpfs vanish at stop
        (dev / "shm").mkdir(parents=True)
        self.state.running.remove(vmid)

    def exec(self, vmid: int, argv: Sequence[str]) -> int:
        rootfs = self.rootfs(vmid)
        env = dict(os.environ)
        env.update(
            PATH=f"{rootfs / 'bin'}:{self.state.effective_ct_path()}",
            HOME=str(rootfs / "root"),
            **{CT_ROOT_ENV: str(rootfs)},
        )
        mapped = [
            self.ct_path(vmid, a) if a.startswith("/") and self._in_ct(vmid, a) else a for a in argv
        ]
        try:
            return subprocess.run(mapped, cwd=rootfs, env=env).returncode
        except FileNotFoundError:
            print(f"lxc-attach: {vmid}: failed to exec '{argv[0]}': No such file or directory")
            return 127

    def ct_path(self, vmid: int, path: str) -> Path:
        return self.rootfs(vmid) / path.lstrip("/")

    def _in_ct(self, vmid: int, path: str) -> bool:
        return os.path.lexists(self.ct_path(vmid, path))

    def push(self, vmid: int, data: bytes, dest: str, mode: int) -> None:
        target = self.ct_path(vmid, dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(mode)

    def pull(self, vmid: int, path: str) -> bytes:
        try:
            return self.ct_path(vmid, path).read_bytes()
        except OSError as exc:
            raise StartError(f"failed to read {path}: {exc.strerror}") from exc

    def destroy(self, vmid: int) -> None:
        shutil.rmtree(self.rootfs(vmid), ignore_errors=True)


def ct_processes(rootfs: Path) -> list[int]:
    """The processes `pct exec` started in this CT and all their descendants: those whose
    environment carries DDOPS_CT_ROOT=<rootfs>, and their children even where those were given a
    clean environment (the supervisor starts the engine with the unit's environment only). Only
    they are stopped with the CT."""
    marker = f"{CT_ROOT_ENV}={rootfs}".encode()
    marked, children = set(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
        children.setdefault(parent, []).append(int(entry))
        if marker in environ.split(b"\0"):
            marked.add(int(entry))
    found, todo = [], sorted(marked)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.append(pid)
            todo += children.get(pid, [])
    return found
