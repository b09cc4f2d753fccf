"""Real LXC containers for the sim's `pct` (root + Debian's lxc): one private lxcpath per sim host.

Like Proxmox, `start` renders the CT's PVE config (through a `StartPlan`) into an LXC config,
then runs `lxc-start`; `exec` is `lxc-attach`, `stop` is `lxc-stop`. The container is the
busybox template (its own /bin, /sbin and init) with the host's /usr, /lib, /lib64 and
/etc/alternatives and the sim state's `extra_binds` (this Python's prefix, this project)
bound read-only, so the host's Python and the installed project run inside. The network
namespace is the host's (`lxc.net.0.type = none`): an engine on 127.0.0.1 inside is reachable
outside. /dev/shm is a real tmpfs: it empties when the container stops.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ops.sim.startplan import SHM_TARGET, StartError, StartPlan
from ops.sim.state import LXC_PATH, SimState, log

# The devices every container needs: null, zero, full, random, urandom, tty, console, ptmx, pts.
DEFAULT_DEVICE_RULES = [
    f"c {n} rwm" for n in ("1:3", "1:5", "1:7", "1:8", "1:9", "5:0", "5:1", "5:2", "136:*")
]
HOST_RO_BINDS = ("/usr", "/lib", "/lib64", "/etc/alternatives")


def devices_cgroup_is_v1() -> bool:
    """True where the devices controller is mounted as cgroup v1 (LXC ignores cgroup2 keys there)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fs_fields = line.split(" - ", 1)[1].split()
            if fs_fields[0] == "cgroup" and "devices" in fs_fields[2].split(","):
                return True
    return False


class LxcContainers:
    """The containers of one sim host, as real LXC containers under PATH/var/lib/lxc."""

    def __init__(self, root: Path, state: SimState) -> None:
        self.root = root
        self.state = state
        self.lxcpath = root / LXC_PATH

    def rootfs(self, vmid: int) -> Path:
        return self.lxcpath / str(vmid) / "rootfs"

    def _lxc(self, tool: str, vmid: int, *args: str) -> subprocess.CompletedProcess:
        argv = [tool, "-P", str(self.lxcpath), "-n", str(vmid), *args]
        return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)

    def _check(self, proc: subprocess.CompletedProcess, what: str) -> None:
        if proc.returncode != 0:
            words = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            raise StartError(f"{what} failed: {words[-1] if words else 'no output'}")

    def create(self, vmid: int) -> None:
        """The busybox template, booting to nothing: no DHCP client (the CT has no network of
        its own), so busybox init reaches its main loop and honours a shutdown signal."""
        if (self.lxcpath / str(vmid) / "config").exists():
            return
        self._check(self._lxc("lxc-create", vmid, "-t", "busybox"), f"lxc-create {vmid}")
        etc = self.rootfs(vmid) / "etc"
        (etc / "init.d/rcS").write_text("#!/bin/sh\n# ddops sim CT: nothing to bring up\n")
        (etc / "inittab").write_text("::sysinit:/etc/init.d/rcS\n")

    def is_running(self, vmid: int) -> bool:
        if not (self.lxcpath / str(vmid) / "config").exists():
            return False
        return self._lxc("lxc-info", vmid, "-s").stdout.split()[-1:] == ["RUNNING"]

    def start(self, vmid: int, plan: StartPlan) -> None:
        self.create(vmid)
        ct_dir = self.lxcpath / str(vmid)
        v1 = devices_cgroup_is_v1()
        config = self.render_config(vmid, plan, v1)
        if v1 and plan.rules:
            rules = f"{len(plan.rules)} device rule(s) (lxc.cgroup2.devices.*, devN)"
            log(
                self.root,
                f"CT {vmid}: cgroup v1 devices controller: {rules} applied as lxc.cgroup.devices.*",
            )
        for ignored in plan.ignored:
            log(self.root, f"CT {vmid}: not applied by the sim: {ignored}")
        (ct_dir / "config").write_text(config)
        if plan.devices:
            hook = ct_dir / "autodev-hook.sh"
            hook.write_text(_autodev_script(plan))
            hook.chmod(0o755)
        log_file = str(ct_dir / "lxc.log")
        self._check(self._lxc("lxc-start", vmid, "-o", log_file, "-l", "WARN"), "lxc-start")

    def stop(self, vmid: int, *, graceful: bool = False, timeout: int = 60) -> None:
        args = ["-t", str(timeout)] if graceful else ["-k"]
        self._check(self._lxc("lxc-stop", vmid, *args), "lxc-stop")

    def exec(self, vmid: int, argv: Sequence[str]) -> int:
        """Run argv inside the CT with this process's stdin/stdout/stderr; the command's exit code.

        The environment is kept, as `pct exec` (lxc-attach's default) keeps it; PATH is the CT's."""
        ct_env = [f"PATH={self.state.effective_ct_path()}", "HOME=/root"]
        return subprocess.run(self._attach(vmid, "--keep-env", ct_env, argv)).returncode

    def _attach(self, vmid: int, env_mode: str, env: list[str], argv: Sequence[str]) -> list[str]:
        """The lxc-attach argv running `argv` in CT `vmid` (env_mode: --keep-env | --clear-env)."""
        set_vars = [arg for assignment in env for arg in ("--set-var", assignment)]
        return [
            "lxc-attach",
            "-P",
            str(self.lxcpath),
            "-n",
            str(vmid),
            env_mode,
            *set_vars,
            "--",
            *argv,
        ]

    def push(self, vmid: int, data: bytes, dest: str, mode: int) -> None:
        # The destination may be on a CT-only mount (/dev/shm): write it from inside.
        script = 'cat > "$1" && chmod "$2" "$1"'
        argv = ["/bin/sh", "-c", script, "sh", dest, f"{mode:o}"]
        proc = subprocess.run(
            self._attach(vmid, "--clear-env", [], argv), input=data, capture_output=True
        )
        if proc.returncode != 0:
            raise StartError(f"failed to write {dest}: {proc.stderr.decode().strip()}")

    def pull(self, vmid: int, path: str) -> bytes:
        proc = subprocess.run(
            self._attach(vmid, "--clear-env", [], ["/bin/cat", path]), capture_output=True
        )
        if proc.returncode != 0:
            raise StartError(f"failed to read {path}: {proc.stderr.decode().strip()}")
        return proc.stdout

    def destroy(self, vmid: int) -> None:
        if (self.lxcpath / str(vmid)).exists():
            self._check(self._lxc("lxc-destroy", vmid), "lxc-destroy")

    def render_config(self, vmid: int, plan: StartPlan, cgroup_v1: bool) -> str:
        """The LXC config for `plan`; device rules spelt for this machine's cgroup version."""
        rule_prefix = "lxc.cgroup.devices" if cgroup_v1 else "lxc.cgroup2.devices"
        lines = [
            f"# Rendered by the ddops sim's pct start from /etc/pve/lxc/{vmid}.conf",
            f"lxc.uts.name = {plan.hostname}",
            f"lxc.rootfs.path = dir:{self.rootfs(vmid)}",
            "lxc.net.0.type = none",
            "lxc.apparmor.profile = unconfined",
            "lxc.signal.halt = SIGUSR2",  # busybox init: poweroff
            "lxc.signal.reboot = SIGTERM",
            "lxc.autodev = 1",
            "lxc.tty.max = 1",
            "lxc.pty.max = 16",
            "lxc.cap.drop = sys_module mac_admin mac_override sys_time",
            "lxc.mount.auto = cgroup:mixed proc:mixed sys:ro",
        ]
        if not plan.has_shm_mount:
            lines.append(f"lxc.mount.entry = shm {SHM_TARGET} tmpfs defaults,create=dir 0 0")
        binds = [*HOST_RO_BINDS, *self.state.extra_binds]
        lines += [
            f"lxc.mount.entry = {p} {p.lstrip('/')} none ro,bind,optional,create=dir 0 0"
            for p in binds
        ]
        lines += [f"lxc.mount.entry = {entry}" for entry in plan.mounts]
        lines.append(f"{rule_prefix}.deny = a")
        lines += [f"{rule_prefix}.allow = {rule}" for rule in DEFAULT_DEVICE_RULES]
        lines += [f"{rule_prefix}.{kind} = {rule}" for kind, rule in plan.rules]
        if plan.devices:
            lines.append(f"lxc.hook.autodev = {self.lxcpath / str(vmid) / 'autodev-hook.sh'}")
        return "\n".join(lines) + "\n"


def _autodev_script(plan: StartPlan) -> str:
    """The autodev hook creating each devN node in the CT's fresh /dev, as Proxmox's hook does."""
    lines = ["#!/bin/sh", "set -e", 'cd "$LXC_ROOTFS_MOUNT/dev"']
    for dev in plan.devices:
        if "/" in dev.name:
            lines.append(shlex.join(["mkdir", "-p", dev.name.rsplit("/", 1)[0]]))
        lines.append(shlex.join(["rm", "-f", dev.name]))
        mknod = ["mknod", "-m", f"{dev.mode:o}", dev.name, "c", str(dev.major), str(dev.minor)]
        lines.append(shlex.join(mknod))
        lines.append(shlex.join(["chown", f"{dev.uid}:{dev.gid}", dev.name]))
    return "\n".join(lines) + "\n"
