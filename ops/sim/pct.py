"""The sim's `pct`: Proxmox's container tool with its real messages and exit codes (0, or 255).

    pct status|config|start|stop|shutdown|reboot|unlock|destroy <vmid>
    pct exec <vmid> -- <argv...>         (the command's own exit code; needs a running CT)
    pct push <vmid> <file> <dest> [--perms 0644]   pct pull <vmid> <path> <dest>
    pct create <vmid> <ostemplate> [--key value ...]   pct set <vmid> [--key value ...] [--delete k,..]
    pct list

On a PVE 9 host (pve-container 6.0.4) `pct set --devN` on a running CT attaches the new node
at once (hot-plug); before 9 it applies at the CT's next start.
Host paths given to push/pull are paths on the simulated host, so they live below its root.
Like Proxmox's lock_config, the commands that edit a CT config (set, create, destroy, unlock)
hold flock on /run/lock/lxc/pve-config-<vmid>.lock while they do, waiting up to 10 s for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from ops.sim import nvidia, pveconf
from ops.sim.hookscript import HookError, run_hook
from ops.sim.launcher import write_launcher
from ops.sim.lxc import LxcContainers
from ops.sim.processct import ProcessContainers
from ops.sim.release import parse_pve_version, release_for
from ops.sim.startplan import StartError, plan_start, resolve_dev
from ops.sim.state import CT_CONF_DIR, SimState, host_lock, load_state, log, save_state

TASK_ERROR = 255
CONFIG_EDITS = ("set", "create", "destroy", "unlock")
CONFIG_LOCK_TIMEOUT_S = 10.0
CT_SIDE_TOOLS = ("nvidia-smi",)
PCT_EXEC_DROPPED_ENV = ("SSL_CERT_FILE", "SSL_CERT_DIR")


class PctError(Exception):
    """A failed pct task; the message is what pct prints."""


def containers_for(root: Path, state: SimState) -> LxcContainers | ProcessContainers:
    """The container backend the sim was initialised with (`state.containers`)."""
    backend = LxcContainers if state.containers == "lxc" else ProcessContainers
    return backend(root, state)


class Pct:
    """One `pct` invocation's view of the sim host."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = load_state(root)
        self.cts = containers_for(root, self.state)

    def _reload_state(self) -> None:
        self.state = load_state(self.root)
        self.cts.state = self.state

    # -- config files -------------------------------------------------------------------------
    def conf_path(self, vmid: int) -> Path:
        return self.root / CT_CONF_DIR / f"{vmid}.conf"

    def conf(self, vmid: int) -> str:
        try:
            return self.conf_path(vmid).read_text()
        except FileNotFoundError:
            raise PctError(
                f"Configuration file 'nodes/{self.state.node}/lxc/{vmid}.conf' does not exist"
            ) from None

    def vmids(self) -> list[int]:
        return sorted(
            int(p.stem) for p in (self.root / CT_CONF_DIR).glob("*.conf") if p.stem.isdigit()
        )

    def _check_unlocked(self, vmid: int, options: dict[str, str]) -> None:
        lock = pveconf.values(self.conf(vmid)).get("lock")
        if lock and options.get("skiplock") != "1":
            raise PctError(f"CT is locked ({lock})")

    def _require_running(self, vmid: int) -> None:
        self.conf(vmid)
        if not self.cts.is_running(vmid):
            raise PctError(f"CT {vmid} not running")

    # -- subcommands ----------------------------------------------------------------------------
    def status(self, vmid: int) -> None:
        self.conf(vmid)
        print(f"status: {'running' if self.cts.is_running(vmid) else 'stopped'}")

    def config(self, vmid: int) -> None:
        found = pveconf.entries(self.conf(vmid))
        pve = sorted((k, v) for k, v in found if not k.startswith("lxc."))
        for key, value in pve + [(k, v) for k, v in found if k.startswith("lxc.")]:
            print(f"{key}: {value}")

    def list(self) -> None:
        print(f"{'VMID':<10} {'Status':<10} {'Lock':<12} Name")
        for vmid in self.vmids():
            settings = pveconf.values(self.conf(vmid))
            running = "running" if self.cts.is_running(vmid) else "stopped"
            print(
                f"{vmid:<10} {running:<10} {settings.get('lock', ''):<12} {settings.get('hostname', '')}"
            )

    def start(self, vmid: int, options: dict[str, str] | None = None) -> None:
        conf = self.conf(vmid)
        self._check_unlocked(vmid, options or {})
        if self.cts.is_running(vmid):
            raise PctError(f"CT {vmid} already running")
        hook = pveconf.values(conf).get("hookscript")
        self._warn_cgroup_v1_keys(conf)
        try:
            if hook:
                run_hook(self.root, hook, vmid, "pre-start")
                self._reload_state()  # the hook may have run nvidia-modprobe
            plan = plan_start(vmid, conf, self.root)
            self.cts.create(vmid, plan.unprivileged)
            self._install_ct_userspace(vmid, self._host_userspace_hook(conf, plan.unprivileged))
            self.cts.start(vmid, plan)
        except (HookError, StartError) as exc:
            raise PctError(f"{exc}\nstartup for container '{vmid}' failed") from None
        if hook:
            run_hook(self.root, hook, vmid, "post-start")

    def _warn_cgroup_v1_keys(self, conf: str) -> None:
        """PVE 9 has cgroup v2 only: pve-container warns on each `lxc.cgroup.*` key (LXC ignores it)."""
        if parse_pve_version(self.state.pve_version)[0] < 9:
            return
        for key, _ in pveconf.entries(conf):
            if key.startswith("lxc.cgroup."):
                print(
                    f"WARN: '{key}' is a cgroup v1 key, ignored on this cgroup v2 only host; "
                    "this will be a hard error in the future",
                    file=sys.stderr,
                )

    def _host_userspace_hook(self, conf: str, unprivileged: bool) -> bool:
        """Whether the config has LXC's NVIDIA mount hook; StartError when the host lacks the
        libnvidia-container tool it calls, or the CT is privileged (the hook runs only in a user
        namespace): LXC fails the start on a failed mount hook."""
        hook = f"/{nvidia.LXC_NVIDIA_HOOK}"
        if not any(k == "lxc.hook.mount" and v == hook for k, v in pveconf.entries(conf)):
            return False
        failed = f"lxc-start: hook: Failed to run mount hook {hook}"
        if not (self.root / nvidia.CONTAINER_CLI).exists():
            raise StartError(
                f"{failed}: /{nvidia.CONTAINER_CLI}: not found (libnvidia-container-tools)"
            )
        if not unprivileged:  # the hook's own words
            raise StartError(
                f"{failed}: FIXME: This hook currently only works in unprivileged mode."
            )
        return True

    def _install_ct_userspace(self, vmid: int, host_mounted: bool) -> None:
        """The CT's driver userspace (a stand-in for libcuda) and its nvidia-smi, as a CT image has;
        with LXC's NVIDIA hook, the host's own, mounted at this start."""
        rootfs = self.cts.rootfs(vmid)
        described = rootfs / nvidia.CT_USERSPACE_FILE
        existing = json.loads(described.read_text()) if described.exists() else None
        described.parent.mkdir(parents=True, exist_ok=True)
        userspace = nvidia.ct_userspace(self.state, existing, host_mounted)
        described.write_text(json.dumps(userspace) + "\n")
        for tool in CT_SIDE_TOOLS:
            write_launcher(rootfs / "bin" / tool, tool, self.root, in_ct=True)

    def stop(self, vmid: int, options: dict[str, str], *, graceful: bool = False) -> None:
        self._check_unlocked(vmid, options)
        self._require_running(vmid)
        try:
            self.cts.stop(vmid, graceful=graceful, timeout=int(options.get("timeout", 60)))
        except StartError as exc:
            raise PctError(str(exc)) from None

    def reboot(self, vmid: int, options: dict[str, str]) -> None:
        self.stop(vmid, options, graceful=True)
        self.start(vmid, options)

    def unlock(self, vmid: int) -> None:
        self.conf_path(vmid).write_text(pveconf.set_keys(self.conf(vmid), {"lock": None}))

    def set(self, vmid: int, options: dict[str, str]) -> None:
        conf = self.conf(vmid)
        self._check_unlocked(vmid, options)
        updates: dict[str, str | None] = {
            k: v for k, v in options.items() if k not in ("delete", "skiplock")
        }
        updates.update({k: None for k in options.get("delete", "").split(",") if k})
        for key in updates:
            if key.startswith("lxc."):  # raw LXC keys need a file edit: pct has no option for them
                raise PctError(f"Unknown option: {key}\n400 unable to parse option")
        planned = pveconf.set_keys(conf, updates)
        self._hotplug_new_devices(vmid, conf, planned)
        self.conf_path(vmid).write_text(planned)

    def _hotplug_new_devices(self, vmid: int, conf: str, planned: str) -> None:
        """PVE 9 (pve-container 6.0.4) attaches a devN entry new to a running CT at once; before,
        it applies at the next start. One the backend cannot attach is warned about, as
        Proxmox warns of a hot-plug error ("unable to hotplug dev3: ..."), and applies at the
        next start; a node that cannot be made fails the set."""
        if not (
            release_for(self.state.pve_version).hotplugs_dev_entries and self.cts.is_running(vmid)
        ):
            return
        before = {dev.key for dev in pveconf.dev_entries(conf)}
        for dev in pveconf.dev_entries(planned):
            if dev.key in before:
                continue
            try:
                why_not = self.cts.hotplug(vmid, resolve_dev(dev, self.root))
            except StartError as exc:
                raise PctError(f"unable to hotplug {dev.key}: {exc}") from None
            if why_not:
                print(f"unable to hotplug {dev.key}: {why_not}", file=sys.stderr)
                log(self.root, f"CT {vmid}: {dev.key} not hot-plugged ({why_not}): next start")

    def create(self, vmid: int, ostemplate: str, options: dict[str, str]) -> None:
        if self.conf_path(vmid).exists():
            raise PctError(
                f"unable to create CT {vmid} - CT {vmid} already exists on node '{self.state.node}'"
            )
        settings = {
            "arch": "amd64",
            "ostype": "debian",
            "rootfs": f"local-lvm:vm-{vmid}-disk-0,size=8G",
        }
        if release_for(self.state.pve_version).unprivileged_default:
            settings["unprivileged"] = "1"  # PVE 9: `--unprivileged 0` asks for a privileged CT
        settings.update({k: v for k, v in options.items() if k not in ("start", "storage")})
        self.conf_path(vmid).parent.mkdir(parents=True, exist_ok=True)
        self.conf_path(vmid).write_text("".join(f"{k}: {v}\n" for k, v in sorted(settings.items())))
        try:
            self.cts.create(vmid, settings.get("unprivileged") == "1")
        except StartError as exc:
            self.conf_path(vmid).unlink()
            raise PctError(f"unable to create CT {vmid} - {exc}") from None
        if options.get("start") == "1":
            self.start(vmid)

    def destroy(self, vmid: int, options: dict[str, str]) -> None:
        self.conf(vmid)
        self._check_unlocked(vmid, options)
        if self.cts.is_running(vmid):
            raise PctError(f"CT {vmid} is running - destroy failed")
        self.cts.destroy(vmid)
        self.conf_path(vmid).unlink()

    def exec(self, vmid: int, argv: list[str]) -> int:
        self._require_running(vmid)
        if not argv:
            raise PctError("400 missing command")
        # Like Proxmox's pct (clean_environment): the host's CA paths would break TLS inside.
        for var in PCT_EXEC_DROPPED_ENV:
            os.environ.pop(var, None)
        return self.cts.exec(vmid, argv)

    def push(self, vmid: int, source: str, dest: str, options: dict[str, str]) -> None:
        self._require_running(vmid)
        try:
            data = self.host_file(source).read_bytes()
        except OSError as exc:
            raise PctError(f"failed to open {source} for reading - {exc.strerror}") from exc
        try:
            self.cts.push(vmid, data, dest, int(options.get("perms", "0644"), 8))
        except StartError as exc:
            raise PctError(str(exc)) from None

    def pull(self, vmid: int, path: str, dest: str) -> None:
        self._require_running(vmid)
        try:
            data = self.cts.pull(vmid, path)
        except StartError as exc:
            raise PctError(str(exc)) from None
        try:
            self.host_file(dest).write_bytes(data)
        except OSError as exc:
            raise PctError(f"failed to open {dest} for writing - {exc.strerror}") from exc

    def host_file(self, path: str) -> Path:
        return self.root / path.lstrip("/") if path.startswith("/") else Path(path)


def parse_options(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(positional args, {option: value}); a bare `--flag` means "1", as pct's boolean options."""
    positional, options = [], {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
            options[arg[2:]] = args[i + 1] if has_value else "1"
            i += 2 if has_value else 1
        else:
            positional.append(arg)
            i += 1
    return positional, options


def _vmid(positional: list[str], usage: str) -> int:
    if not positional or not positional[0].isdigit():
        raise PctError(f"400 not enough arguments\n{usage}")
    return int(positional[0])


def main(root: Path, args: list[str]) -> int:
    """Run `pct args...` against the sim host at `root`; the exit code."""
    if not args:
        print("USAGE: pct <COMMAND> [ARGS] [OPTIONS]", file=sys.stderr)
        return TASK_ERROR
    command, rest = args[0], args[1:]
    if command == "exec":
        before, _, argv = _split_dashdash(rest)
        try:
            return Pct(root).exec(_vmid(before, "pct exec <vmid> [<extra-args>]"), argv)
        except PctError as exc:
            print(exc, file=sys.stderr)
            return TASK_ERROR
    try:
        with config_lock(root, command, rest), host_lock(root):
            pct = Pct(root)
            _dispatch(pct, command, rest)
            save_state(root, pct.state)
    except PctError as exc:
        print(exc, file=sys.stderr)
        return TASK_ERROR
    return 0


@contextlib.contextmanager
def config_lock(root: Path, command: str, args: list[str]) -> Iterator[None]:
    """PVE::LXC::Config->lock_config for the commands that edit a CT config."""
    if command not in CONFIG_EDITS or not args or not args[0].isdigit():
        yield
        return
    name = f"/run/lock/lxc/pve-config-{int(args[0])}.lock"
    path = root / name.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        if not _flock_within(f, CONFIG_LOCK_TIMEOUT_S):
            raise PctError(f"can't lock file '{name}' - got timeout")
        yield


def _flock_within(f, timeout: float) -> bool:
    """A blocking flock(2) under an alarm, as PVE::Tools::lock_file waits (main thread only)."""

    def expire(signum, frame):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        fcntl.flock(f, fcntl.LOCK_EX)
        return True
    except TimeoutError:
        return False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _split_dashdash(args: list[str]) -> tuple[list[str], bool, list[str]]:
    if "--" in args:
        i = args.index("--")
        return args[:i], True, args[i + 1 :]
    return args[:1], False, args[1:]


def _dispatch(pct: Pct, command: str, args: list[str]) -> None:
    positional, options = parse_options(args)
    usage = f"pct {command} <vmid>"
    by_vmid: dict[str, Callable[[int], None]] = {
        "status": pct.status,
        "config": pct.config,
        "start": lambda v: pct.start(v, options),
        "stop": lambda v: pct.stop(v, options),
        "shutdown": lambda v: pct.stop(v, options, graceful=True),
        "reboot": lambda v: pct.reboot(v, options),
        "unlock": pct.unlock,
        "set": lambda v: pct.set(v, options),
        "destroy": lambda v: pct.destroy(v, options),
    }
    if command == "list":
        pct.list()
    elif command in by_vmid:
        by_vmid[command](_vmid(positional, usage))
    elif command in ("push", "pull", "create"):
        need = 2 if command == "create" else 3
        if len(positional) < need:
            raise PctError(f"400 not enough arguments\npct {command} <vmid> ...")
        vmid = _vmid(positional, usage)
        if command == "push":
            pct.push(vmid, positional[1], positional[2], options)
        elif command == "pull":
            pct.pull(vmid, positional[1], positional[2])
        else:
            pct.create(vmid, positional[1], options)
    else:
        raise PctError(f"unknown command 'pct {command}'")
