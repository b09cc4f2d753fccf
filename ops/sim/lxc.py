"""Real LXC containers for the sim's `pct` (root + Debian's lxc): one private lxcpath per sim host.

Like Proxmox, `start` renders the CT's PVE config (through a `StartPlan`) into an LXC config,
then runs `lxc-start`; `exec` is `lxc-attach`, `stop` is `lxc-stop`. The container is the
busybox template (its own /bin, /sbin and init) with the host's /usr, /lib, /lib64 and
/etc/alternatives and the sim state's `extra_binds` (this Python's prefix, this project)
bound read-only, so the host's Python and the installed project run inside. The network
namespace is the host's (`lxc.net.0.type = none`): an engine on 127.0.0.1 inside is reachable
outside. /dev/shm is a real tmpfs: it empties when the container stops.

An unprivileged CT (`unprivileged: 1`) runs in a user namespace, ids 0..65535 mapped to
100000.. as Proxmox maps them (root needs that range in /etc/subuid and /etc/subgid, as a
Proxmox host has it: `root:100000:65536`); its rootfs is owned by the mapped ids from its
creation, as `pct create` extracts a template. Without the range the CT runs privileged and the
sim's log says so. devN nodes are made in the CT's passthrough directory (mode, mapped owner)
and bind-mounted onto its /dev, as Proxmox's start hook does.

The root of an unprivileged CT may not walk the paths that lead to the sim root (a 0700
temporary directory) nor to the host directories bound into it (a Python under /root), and LXC
requires it to reach its lxcpath, rootfs and mount sources. So for such a CT the sim root is
seen at /run/ddops-sim/<key> (0755 all the way): `lxc-start` runs in a mount namespace of its
own (`unshare`) where the host's root binds the sim root there and each host directory onto the
CT's binds/<i>; the mounts live and die with the CT, and the config names paths below that
place. On the host it holds only a copy of the CT's config, so lxc-attach, lxc-info and
lxc-stop, given that lxcpath, find the container.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ops.sim.startplan import SHM_TARGET, CtDevice, StartError, StartPlan
from ops.sim.state import LXC_PATH, SimState, log

# The devices every container needs: null, zero, full, random, urandom, tty, console, ptmx, pts.
DEFAULT_DEVICE_RULES = [
    f"c {n} rwm" for n in ("1:3", "1:5", "1:7", "1:8", "1:9", "5:0", "5:1", "5:2", "136:*")
]
HOST_RO_BINDS = ("/usr", "/lib", "/lib64", "/etc/alternatives")
ID_MAP_BASE, ID_MAP_SIZE = 100000, 65536  # Proxmox's map for unprivileged CTs
ROOTFS_BASE_FILE = "rootfs.idbase"  # the host id the CT's rootfs root is owned by
REACHABLE_DIR = Path("/run/ddops-sim")  # unprivileged CTs' directories, bound here (see above)


def subordinate_ids_for_root() -> bool:
    """Whether root may map Proxmox's range (newuidmap reads /etc/subuid and /etc/subgid)."""
    wanted = f"root:{ID_MAP_BASE}:{ID_MAP_SIZE}"
    try:
        return all(
            wanted in Path(f"/etc/{name}").read_text().split() for name in ("subuid", "subgid")
        )
    except FileNotFoundError:
        return False


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
        argv = [tool, "-P", str(self.lxc_path(vmid)), "-n", str(vmid), *args]
        return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)

    def lxc_path(self, vmid: int) -> Path:
        """The lxcpath LXC knows the CT by: the real one, or for an unprivileged CT the one its
        mapped root can reach (see the module's docstring)."""
        return self.reachable() / LXC_PATH if self.id_base(vmid) else self.lxcpath

    def reachable(self) -> Path:
        """Where an unprivileged CT sees the sim root."""
        key = hashlib.sha1(str(self.root).encode(), usedforsecurity=False).hexdigest()[:16]
        return REACHABLE_DIR / key

    def seen(self, vmid: int, path: str) -> str:
        """A host path as the CT's start sees it: below the reachable sim root when unprivileged."""
        below = Path(path).is_relative_to(self.root) and self.id_base(vmid)
        return str(self.reachable() / Path(path).relative_to(self.root)) if below else path

    def _check(self, proc: subprocess.CompletedProcess, what: str) -> None:
        if proc.returncode != 0:
            words = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            raise StartError(f"{what} failed: {words[-1] if words else 'no output'}")

    def create(self, vmid: int, unprivileged: bool = False) -> None:
        """The busybox template, booting to nothing: no DHCP client (the CT has no network of
        its own), so busybox init reaches its main loop and honours a shutdown signal. An
        unprivileged CT's files belong to its mapped ids from the start."""
        if (self.lxcpath / str(vmid) / "config").exists():
            return
        self._check(self._lxc("lxc-create", vmid, "-t", "busybox"), f"lxc-create {vmid}")
        etc = self.rootfs(vmid) / "etc"
        (etc / "init.d/rcS").write_text("#!/bin/sh\n# ddops sim CT: nothing to bring up\n")
        (etc / "inittab").write_text("::sysinit:/etc/init.d/rcS\n")
        if unprivileged and subordinate_ids_for_root():
            _shift_ids(self.rootfs(vmid), ID_MAP_BASE)
            (self.lxcpath / str(vmid) / ROOTFS_BASE_FILE).write_text(f"{ID_MAP_BASE}\n")
            (self.lxcpath / str(vmid)).chmod(0o755)  # the mapped root must reach its rootfs

    def id_base(self, vmid: int) -> int:
        """The host id of the CT's root: 0, or the mapped base of an unprivileged CT."""
        marker = self.lxcpath / str(vmid) / ROOTFS_BASE_FILE
        return int(marker.read_text()) if marker.exists() else 0

    def is_running(self, vmid: int) -> bool:
        if not (self.lxcpath / str(vmid) / "config").exists():
            return False
        return self._lxc("lxc-info", vmid, "-s").stdout.split()[-1:] == ["RUNNING"]

    def start(self, vmid: int, plan: StartPlan) -> None:
        self.create(vmid, plan.unprivileged)
        ct_dir = self.lxcpath / str(vmid)
        if plan.unprivileged and not self.id_base(vmid):
            log(
                self.root,
                f"CT {vmid}: unprivileged in its config but run privileged: root has no "
                f"subordinate ids (add root:{ID_MAP_BASE}:{ID_MAP_SIZE} to /etc/subuid and "
                "/etc/subgid, as on a Proxmox host)",
            )
        self._make_passthrough_nodes(vmid, plan)
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
        log_file = str(ct_dir / "lxc.log")
        argv = ["lxc-start", "-P", str(self.lxc_path(vmid)), "-n", str(vmid)]
        argv += ["-o", log_file, "-l", "WARN"]
        if self.id_base(vmid):
            known = self.lxc_path(vmid) / str(vmid)
            known.mkdir(mode=0o755, parents=True, exist_ok=True)
            (known / "config").write_text(config)  # for the tools run on the host
            argv = self._with_staged_binds(vmid, argv)
        proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        self._check(proc, "lxc-start")

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
            str(self.lxc_path(vmid)),
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
        if self.id_base(vmid):
            shutil.rmtree(self.lxc_path(vmid) / str(vmid), ignore_errors=True)
            with contextlib.suppress(OSError):  # others of this host may still be there
                for empty in (self.lxc_path(vmid), *self.lxc_path(vmid).parents):
                    if empty == REACHABLE_DIR:
                        break
                    empty.rmdir()
        if (self.lxcpath / str(vmid)).exists():
            argv = ["lxc-destroy", "-P", str(self.lxcpath), "-n", str(vmid)]
            proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            self._check(proc, "lxc-destroy")

    def host_binds(self) -> list[str]:
        """The host directories bound read-only into every CT."""
        return [*HOST_RO_BINDS, *self.state.extra_binds]

    def ct_dir_for_lxc(self, vmid: int) -> Path:
        """The CT's directory as LXC sees it."""
        return self.lxc_path(vmid) / str(vmid)

    def _with_staged_binds(self, vmid: int, argv: list[str]) -> list[str]:
        """`argv` (lxc-start) run in a mount namespace of its own where the host's root binds
        the real lxcpath onto the reachable one and each host directory onto binds/<i> there."""
        reach = self.reachable()
        REACHABLE_DIR.chmod(0o755)
        mounts = [f"mount --bind {shlex.quote(str(self.root))} {shlex.quote(str(reach))}"]
        for i, source in enumerate(self.host_binds()):
            if os.path.isdir(source):
                (self.lxcpath / str(vmid) / "binds" / str(i)).mkdir(parents=True, exist_ok=True)
                target = self.lxc_path(vmid) / str(vmid) / "binds" / str(i)
                mounts.append(f"mount --bind {shlex.quote(source)} {shlex.quote(str(target))}")
        script = " && ".join([*mounts, 'exec "$@"'])
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]

    def passthrough(self, vmid: int) -> Path:
        """Where the CT's devN nodes are made before they are bound onto its /dev."""
        return self.lxcpath / str(vmid) / "passthrough"

    def _make_passthrough_nodes(self, vmid: int, plan: StartPlan) -> None:
        for dev in plan.devices:
            self._make_passthrough_node(vmid, dev)

    def _make_passthrough_node(self, vmid: int, dev: CtDevice) -> Path:
        """The devN node with the numbers the host node has now, its mode, and its owner as
        the CT sees it (mapped for an unprivileged CT), as Proxmox's pre-start hook makes it."""
        base = self.id_base(vmid)
        node = self.passthrough(vmid) / "dev" / dev.name
        node.parent.mkdir(parents=True, exist_ok=True)
        node.unlink(missing_ok=True)
        os.mknod(node, stat.S_IFCHR | dev.mode, os.makedev(dev.major, dev.minor))
        os.chmod(node, dev.mode)
        os.chown(node, base + dev.uid, base + dev.gid)
        return node

    def hotplug(self, vmid: int, dev: CtDevice) -> str | None:
        """Attach a devN node to the running CT (PVE 9's hot-plug), as `lxc-device add` does
        (which cannot enter a CT here): the grant in the CT's devices cgroup now (`lxc-cgroup`:
        a cgroup v1 devices.allow write, or on cgroup v2 LXC's replacement of the CT's device
        program), then the node made in its /dev. None once attached; else why not, and the
        entry applies at the CT's next start: an unprivileged CT, whose nodes are bind mounts
        the sim makes at start only, or a grant this machine's LXC could not apply live."""
        if self.id_base(vmid):
            return "unprivileged CT: its node is bound at start"
        rule = f"c {dev.major}:{dev.minor} rwm"
        granted = self._lxc("lxc-cgroup", vmid, "devices.allow", rule)
        if granted.returncode != 0:
            said = (granted.stderr.strip() or granted.stdout.strip()).splitlines()
            version = "v1" if devices_cgroup_is_v1() else "v2"
            return f"cgroup {version} live grant `{rule}` refused ({said[-1] if said else 'no output'})"
        path = f"/dev/{dev.name}"
        script = 'mknod -m "$2" "$1" c "$3" "$4" && chown "$5:$6" "$1"'
        args = [path, f"{dev.mode:o}", str(dev.major), str(dev.minor), str(dev.uid), str(dev.gid)]
        made = subprocess.run(
            self._attach(vmid, "--clear-env", [], ["/bin/sh", "-c", script, "sh", *args]),
            capture_output=True,
            text=True,
        )
        self._check(made, f"mknod {path}")
        return None

    def render_config(self, vmid: int, plan: StartPlan, cgroup_v1: bool) -> str:
        """The LXC config for `plan`; device rules spelt for this machine's cgroup version."""
        rule_prefix = "lxc.cgroup.devices" if cgroup_v1 else "lxc.cgroup2.devices"
        base, ct_dir = self.id_base(vmid), self.ct_dir_for_lxc(vmid)
        # sysfs cannot be mounted in a user namespace that shares the host's network namespace
        auto = "cgroup:mixed proc:rw" if base else "cgroup:mixed proc:mixed sys:ro"
        lines = [
            f"# Rendered by the ddops sim's pct start from /etc/pve/lxc/{vmid}.conf",
            f"lxc.uts.name = {plan.hostname}",
            f"lxc.rootfs.path = dir:{ct_dir / 'rootfs'}",
            "lxc.net.0.type = none",
            "lxc.apparmor.profile = unconfined",
            "lxc.signal.halt = SIGUSR2",  # busybox init: poweroff
            "lxc.signal.reboot = SIGTERM",
            "lxc.autodev = 1",
            "lxc.tty.max = 1",
            "lxc.pty.max = 16",
            "lxc.cap.drop = sys_module mac_admin mac_override sys_time",
            f"lxc.mount.auto = {auto}",
        ]
        if base:
            lines += [f"lxc.idmap = {kind} 0 {base} {ID_MAP_SIZE}" for kind in "ug"]
        if not plan.has_shm_mount:
            lines.append(f"lxc.mount.entry = shm {SHM_TARGET} tmpfs defaults,create=dir 0 0")
        lines += [
            f"lxc.mount.entry = {ct_dir / 'binds' / str(i) if base else p} {p.lstrip('/')} "
            "none ro,bind,optional,create=dir 0 0"
            for i, p in enumerate(self.host_binds())
        ]
        lines += [
            f"lxc.mount.entry = {self.seen(vmid, entry.split()[0])} {entry.split(maxsplit=1)[1]}"
            for entry in plan.mounts
        ]
        lines += [
            f"lxc.mount.entry = {ct_dir / 'passthrough' / 'dev' / dev.name} dev/{dev.name} "
            "none bind,create=file 0 0"
            for dev in plan.devices
        ]
        lines.append(f"{rule_prefix}.deny = a")
        lines += [f"{rule_prefix}.allow = {rule}" for rule in DEFAULT_DEVICE_RULES]
        lines += [f"{rule_prefix}.{kind} = {rule}" for kind, rule in plan.rules]
        return "\n".join(lines) + "\n"


def _shift_ids(root: Path, base: int) -> None:
    """Own every file below `root` (itself too) by its id + base, as an unprivileged CT's
    template is extracted: the CT's root then owns its files."""
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        os.lchown(path, st.st_uid + base, st.st_gid + base)
