"""The engine in a container: install it, run it as a service, check it is ready and generates.

    install_engine(t, 200, engine)             # real host: /opt/ddops/venv + pip; sim: verify only
    spec = EngineDeployment(200, engine, "/dev/shm/models/target", "/dev/shm/models/draft")
    ensure_service(t, spec, dry_run)           # its user, unit and service; a diff with dry_run
    wait_ready(t, 200, engine, timeout=600)    # /ready, then a real 4-token generation
    service_problem(t, 200)                    # None, or one line saying what is wrong

Everything runs inside the CT through `pct exec` / `pct push` over a Transport. The service is
ops/render.py's EngineUnit, rendered once: a CT with systemd (/run/systemd/system) gets it as
/etc/systemd/system/ddops-engine.service; a CT without (busybox, Alpine) gets the same file as
/etc/ddops/ddops-engine.service, run by the ddops supervisor (ops/agents/supervise.py) started
detached inside the CT. Either way the engine runs as its own user (ddops-engine, created here,
in the group that owns the CT's GPU nodes), not root. The API key belongs to the host side: it
lives in /etc/ddops/engine.env (0600, root's: systemd or the supervisor reads it before the
engine starts) in the CT. The unit requires that file, so an engine never starts without the key
it was given; without a key (`provision --no-api-key`) the file is there and says so. Only
`provision` changes it (install or rotate the operator's DDOPS_API_KEY, generate one when none is
installed, remove it when told); recover and the boot units keep it. It travels on stdin: never on
a command line, in a log or a diff.
Tests: tests/integration/test_deploy.py (real LXC containers on a simulated host, a tiny model).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from engine.server import API_KEY_ENV
from ops.agents import engine_probe, supervise
from ops.chain.report import Outcome
from ops.diffs import unified_diff
from ops.errors import DdopsError
from ops.host.pve import ct_exec, ct_push, validate_vmid
from ops.host.transport import Result, Transport
from ops.host.wheel import built_wheel, ddops_version
from ops.render import EngineUnit, render
from ops.site.inventory import EngineSpec

ENV_FILE = "/etc/ddops/engine.env"
ENGINE_USER = "ddops-engine"
NO_KEY_TEXT = "# No API key: `ddops provision --no-api-key` removed it; the engine asks for none.\n"
SUPERVISED_UNIT = "/etc/ddops/ddops-engine.service"
SYSTEMD_UNIT_NAME = "ddops-engine.service"
PUSH_DIR = "/var/lib/ddops/push"  # host-side copies of files pushed into CTs (never secrets)
CT_WHEEL_DIR = "/var/lib/ddops/wheels"  # in the CT: root's, not a world-writable /tmp
ENGINE_HOST = "127.0.0.1"
LOG_LINES = 20
WAIT_SLICE_S = 6.0  # how long one probe waits in the CT for a starting engine
POLL_S = 1.0  # the least time between two probes
PIP_TIMEOUT_S = 3600.0  # torch and its CUDA libraries are gigabytes

# Run by the engine's Python in the CT: the engine and torch import, and which ddops they are.
IMPORT_CHECK = (
    "import importlib.metadata, engine, torch; print(importlib.metadata.version('ddops'))"
)

# The engine's health probe (stdlib only), run by the engine's Python in the CT from stdin
ENGINE_PROBE = Path(engine_probe.__file__)


# -- install -----------------------------------------------------------------------------------
def engine_problem(t: Transport, vmid: int | str, engine: EngineSpec) -> str | None:
    """None when the engine's Python in the CT imports engine and torch from this ddops version."""
    r = ct_exec(t, vmid, [engine.python, "-c", IMPORT_CHECK], timeout=300)
    where = f"engine python {engine.python} in CT {validate_vmid(vmid)}"
    if r.rc in (126, 127):
        return f"{where}: not found"
    if not r.ok:
        return f"{where}: {_last_words(r)}"
    installed, wanted = r.stdout.strip(), ddops_version()
    if installed != wanted:
        return f"{where}: has ddops {installed}, this is ddops {wanted}"
    return None


def install_engine(t: Transport, vmid: int | str, engine: EngineSpec) -> Outcome:
    """Make the engine importable by engine.python: unchanged when it is; else, when engine.python
    is a venv's Python that ddops may own, create the venv and pip install ddops[engine] into it."""
    problem = engine_problem(t, vmid, engine)
    if problem is None:
        return Outcome(False, f"ddops {ddops_version()} engine importable by {engine.python}")
    venv = _managed_venv(t, vmid, engine.python, problem)
    _run(t, vmid, ["python3", "-m", "venv", venv], "create the engine venv", timeout=300)
    requirement = _push_wheel(t, vmid) or f"ddops[engine]=={ddops_version()}"
    pip = [engine.python, "-m", "pip", "install", "--upgrade", requirement]
    _run(t, vmid, pip, "pip install the engine", timeout=PIP_TIMEOUT_S)
    if still := engine_problem(t, vmid, engine):
        raise DdopsError(f"CT {vmid}", f"engine installed but not usable: {still}")
    return Outcome(True, f"installed ddops[engine] {ddops_version()} into {venv}")


def _managed_venv(t: Transport, vmid: int | str, python: str, problem: str) -> str:
    """The venv directory of `python` when ddops may create or update it (absent, or a venv)."""
    path = PurePosixPath(python)
    venv = str(path.parent.parent)
    if path.parent.name == "bin" and venv != "/":
        kind = ct_exec(t, vmid, ["sh", "-c", _PATH_KIND, "sh", venv]).stdout.strip()
        if kind in ("absent", "venv"):
            return venv
    raise DdopsError(
        f"CT {vmid}",
        f"{problem}; ddops installs the engine only into a venv it owns "
        f"(engine python like /opt/ddops/venv/bin/python), not into {python}",
    )


_PATH_KIND = 'if [ ! -e "$1" ]; then echo absent; elif [ -f "$1/pyvenv.cfg" ]; then echo venv; else echo other; fi'


def _push_wheel(t: Transport, vmid: int | str) -> str | None:
    """Push this ddops, as a wheel built from its source tree, into the CT and return the pip
    requirement naming it; None when there is no source tree."""
    with built_wheel() as wheel:
        if wheel is None:
            return None
        dest = f"{CT_WHEEL_DIR}/{wheel.name}"
        _push(t, vmid, wheel.read_bytes(), dest)
    return f"{dest}[engine]"


def _run(
    t: Transport,
    vmid: int | str,
    argv: list[str],
    what: str,
    *,
    timeout: float = 120.0,
    input: str | None = None,
) -> str:
    """Run argv in the CT; its stdout, or DdopsError with `what` and the command's last words."""
    r = ct_exec(t, vmid, argv, timeout=timeout, input=input)
    if not r.ok:
        raise DdopsError(f"CT {validate_vmid(vmid)}", f"{what} failed: {_last_words(r)}")
    return r.stdout


def _last_words(r: Result, *, stdout_first: bool = False) -> str:
    """The last line a failed command said (stderr first, unless it reports on stdout)."""
    streams = (r.stdout, r.stderr) if stdout_first else (r.stderr, r.stdout)
    lines = (streams[0].strip() or streams[1].strip()).splitlines()
    return lines[-1] if lines else f"exited {r.rc}"


def _push(t: Transport, vmid: int | str, data: bytes | str, dest: str, perms: int = 0o644) -> None:
    """Put `data` at `dest` in the CT through a host-side copy and `pct push` (not for secrets)."""
    staged = f"{PUSH_DIR}/{validate_vmid(vmid)}/{PurePosixPath(dest).name}"
    t.write_file(staged, data, backup=False)
    _run(t, vmid, ["mkdir", "-p", str(PurePosixPath(dest).parent)], f"mkdir for {dest}")
    ct_push(t, vmid, staged, dest, perms=perms)


def _read_ct_file(t: Transport, vmid: int | str, path: str) -> str | None:
    r = ct_exec(t, vmid, ["cat", path])
    return r.stdout if r.ok else None


# -- the unit ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineDeployment:
    """The engine's service in one CT: the inventory's engine settings, the staged models it
    serves, how many GPUs the CT has, and the group that owns their nodes (the engine's)."""

    vmid: int
    engine: EngineSpec
    model_dir: str
    draft_dir: str | None = None
    gpu_count: int = 0
    gid: int = 44


def engine_unit(t: Transport, deployment: EngineDeployment) -> EngineUnit:
    """The engine's unit for this host: EngineSpec's "auto" dtype/device become CUDA + bfloat16
    on a real host, CPU + float32 on a simulated one (it has no GPU behind its device nodes).
    On CUDA the engine sees the CT's `gpu_count` GPUs as 0..gpu_count-1 (CUDA_VISIBLE_DEVICES);
    TP rank r uses GPU r. It runs as ENGINE_USER in group `gid`, which owns the GPU nodes, and
    reads its API key from ENV_FILE."""
    engine, gpu_count = deployment.engine, deployment.gpu_count
    device, dtype = engine_device_dtype(t, engine)
    return EngineUnit(
        python=engine.python,
        model=deployment.model_dir,
        draft=deployment.draft_dir,
        host=ENGINE_HOST,
        port=engine.port,
        max_model_len=engine.max_model_len,
        max_num_seqs=engine.max_num_seqs,
        kv_cache_tokens=engine.kv_cache_tokens,
        method=engine.method,
        budget=engine.budget,
        tp=engine.tp,
        dtype=dtype,
        device=device,
        env_file=ENV_FILE,
        user=ENGINE_USER,
        gid=deployment.gid,
        cuda_visible_devices=(
            ",".join(map(str, range(gpu_count))) if device == "cuda" and gpu_count else None
        ),
    )


def engine_device_dtype(t: Transport, engine: EngineSpec) -> tuple[str, str]:
    """EngineSpec's "auto" resolved: CUDA + bfloat16 on a real host, CPU + float32 on a simulated
    one (no GPU behind its device nodes)."""
    device = engine.device if engine.device != "auto" else ("cpu" if t.sysroot else "cuda")
    dtype = (
        engine.dtype if engine.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
    )
    return device, dtype


# -- service managers: systemd, or the ddops supervisor ----------------------------------------
@dataclass(frozen=True)
class ServiceState:
    """The service as its manager sees it."""

    running: bool  # the service is up (it may be between engine restarts)
    engine_up: bool  # the engine process runs now
    exits: int  # engine exits counted by the manager while it runs
    words: str  # the manager's own description, for messages


class ServiceManager(ABC):
    unit_path: str
    kind: str

    def __init__(self, t: Transport, vmid: str) -> None:
        self.t, self.vmid = t, vmid
        self.unit_text: str | None = None  # the installed unit, once read or written here

    def run(self, argv: list[str], what: str, timeout: float = 120.0) -> str:
        return _run(self.t, self.vmid, argv, what, timeout=timeout)

    def install(self, unit_text: str) -> None:
        _push(self.t, self.vmid, unit_text, self.unit_path)
        self.unit_text = unit_text

    def installed_unit(self) -> str | None:
        """The unit installed in the CT (read once per manager), None when there is none."""
        if self.unit_text is None:
            self.unit_text = _read_ct_file(self.t, self.vmid, self.unit_path)
        return self.unit_text

    @abstractmethod
    def state(self) -> ServiceState: ...

    @abstractmethod
    def start(self) -> None:
        """Start the service (enabled at boot where the manager can)."""

    @abstractmethod
    def restart(self) -> None: ...

    @abstractmethod
    def log_tail(self) -> str: ...


class Systemd(ServiceManager):
    unit_path = EngineUnit.INSTALL_PATH
    kind = "systemd"

    def install(self, unit_text: str) -> None:
        super().install(unit_text)
        self.run(["systemctl", "daemon-reload"], "systemctl daemon-reload")

    def state(self) -> ServiceState:
        props = ["ActiveState", "SubState", "NRestarts", "ExecMainStatus"]
        argv = ["systemctl", "show", SYSTEMD_UNIT_NAME, *(f"--property={p}" for p in props)]
        shown = dict(line.split("=", 1) for line in self.run(argv, "systemctl show").splitlines())
        active, sub = shown.get("ActiveState", "unknown"), shown.get("SubState", "unknown")
        engine_up = active == "active" and sub == "running"
        restarts = int(shown.get("NRestarts") or 0)
        words = f"{active} ({sub}), last exit status {shown.get('ExecMainStatus', '?')}"
        running = active in ("active", "activating", "reloading")
        # NRestarts counts restarts done; an engine down now has exited once more than that.
        return ServiceState(running, engine_up, restarts + (not engine_up), words)

    def start(self) -> None:
        self.run(["systemctl", "enable", "--now", SYSTEMD_UNIT_NAME], "systemctl enable --now")

    def restart(self) -> None:
        self.run(["systemctl", "restart", SYSTEMD_UNIT_NAME], "systemctl restart")

    def log_tail(self) -> str:
        journal = ["journalctl", "--unit", SYSTEMD_UNIT_NAME, "--lines", str(LOG_LINES)]
        return ct_exec(self.t, self.vmid, [*journal, "--no-pager", "--output", "cat"]).stdout


# Prints "alive", "gone" (pidfile, no supervisor) or "none" (no pidfile), then the status JSON.
_SUPERVISOR_FACTS = (
    'pid=$(cat "$1" 2>/dev/null) || { echo none; exit 0; }; '
    'if tr "\\000" " " < "/proc/$pid/cmdline" 2>/dev/null | grep -q "$3"; '
    "then echo alive; else echo gone; fi; "
    'cat "$2" 2>/dev/null; exit 0'
)


class Supervised(ServiceManager):
    unit_path = SUPERVISED_UNIT
    kind = "ddops supervisor"

    def state(self) -> ServiceState:
        args = [supervise.PIDFILE, supervise.STATUS_FILE, supervise.SUPERVISOR_MODULE]
        lines = self.run(["sh", "-c", _SUPERVISOR_FACTS, "sh", *args], "reading the supervisor")
        verdict, _, status_json = lines.partition("\n")
        try:
            status = supervise.Status(**json.loads(status_json))
        except (ValueError, TypeError):
            status = supervise.Status()
        running = verdict.strip() == "alive"
        if not running:
            words = "no supervisor" + (
                " (its pidfile is stale)" if verdict.strip() == "gone" else ""
            )
        elif status.engine_pid is not None:
            words = f"engine pid {status.engine_pid}, {status.starts} start(s)"
        else:
            words = f"the engine exited with {status.last_exit}; the supervisor restarts it"
        return ServiceState(running, running and status.engine_pid is not None, status.exits, words)

    def _python(self) -> str:
        """The engine's Python, from the installed unit's ExecStart: it runs the supervisor too."""
        text = self.installed_unit()
        if text is None:
            raise DdopsError(
                f"CT {self.vmid}", f"no engine unit at {self.unit_path}: provision first"
            )
        return supervise.parse_unit(text).argv[0]

    def start(self) -> None:
        argv = [
            self._python(),
            "-m",
            supervise.SUPERVISOR_MODULE,
            "start",
            "--unit",
            self.unit_path,
        ]
        self.run(argv, "starting the ddops supervisor")

    def restart(self) -> None:
        python = self._python()
        self.run(
            [python, "-m", supervise.SUPERVISOR_MODULE, "stop"], "stopping the ddops supervisor"
        )
        self.start()

    def log_tail(self) -> str:
        return ct_exec(self.t, self.vmid, ["tail", "-n", str(LOG_LINES), supervise.LOG_FILE]).stdout


def service_manager(t: Transport, vmid: int | str) -> ServiceManager:
    """systemd when the CT runs it (/run/systemd/system exists), else the ddops supervisor."""
    vmid = validate_vmid(vmid)
    has_systemd = ct_exec(t, vmid, ["test", "-d", "/run/systemd/system"]).ok
    return (Systemd if has_systemd else Supervised)(t, vmid)


# -- the service -------------------------------------------------------------------------------
def service_problem(t: Transport, vmid: int | str) -> str | None:
    """None when the engine service runs its engine now; else one line saying how it is."""
    manager = service_manager(t, vmid)
    state = manager.state()
    if state.engine_up:
        return None
    how = "restarting the engine" if state.running else "not running"
    return f"engine service in CT {manager.vmid} is {how} ({manager.kind}: {state.words})"


def ensure_service(
    t: Transport,
    deployment: EngineDeployment,
    dry_run: bool,
    manager: ServiceManager | None = None,
) -> Outcome:
    """The engine's user there, the rendered unit installed (its diff shown) and the service
    running. A changed unit restarts a running service. The API key file is never touched here
    (see `apply_api_key`). `manager`: the CT's, when the caller has it (one `pct exec` less)."""
    manager = manager or service_manager(t, deployment.vmid)
    unit_text = render(engine_unit(t, deployment))
    current = manager.installed_unit()
    diff = unified_diff(current, unit_text, f"CT {manager.vmid}:{manager.unit_path}")
    running = manager.state().running
    restart = "start the service" if not running else "restart the service" if diff else None
    plan = [step for step in ("write the unit" if diff else None, restart) if step]
    if not plan:
        return Outcome(False, f"running ({manager.kind})")
    if dry_run:
        return Outcome(True, f"would {', '.join(plan)} ({manager.kind})", diff)
    if _installed_key_digest(t, manager.vmid) is None:
        raise DdopsError(
            f"CT {manager.vmid}",
            f"{ENV_FILE} is missing and the engine's unit requires it: `ddops provision` "
            "installs the API key (or, with --no-api-key, a file saying there is none)",
        )
    ensure_engine_user(t, manager.vmid, deployment.gid)
    if diff:
        manager.install(unit_text)
    if running:
        manager.restart()
    else:
        manager.start()
    return Outcome(True, f"did {', '.join(plan)} ({manager.kind})", diff)


# Makes the engine's system user ("$1", no home, no login) with primary group "$2" (a gid): the
# group of that gid if the CT has one (Debian's video is 44), else ddops-gpu. useradd/groupadd
# (shadow's, Debian), else busybox's adduser/addgroup (Alpine). Does nothing when the user exists.
_ENSURE_USER = """set -e
user="$1"; gid="$2"
id -u "$user" >/dev/null 2>&1 && exit 0
group=$(awk -F: -v g="$gid" '$3 == g { print $1; exit }' /etc/group)
if [ -z "$group" ]; then
    group=ddops-gpu
    if command -v groupadd >/dev/null; then groupadd -r -g "$gid" "$group"
    else addgroup -S -g "$gid" "$group"; fi
fi
if command -v useradd >/dev/null; then
    useradd -r -M -N -g "$gid" -d /nonexistent -s /usr/sbin/nologin "$user"
else
    adduser -S -D -H -h /nonexistent -s /sbin/nologin -G "$group" "$user"
fi
"""


def ensure_engine_user(t: Transport, vmid: int | str, gid: int) -> None:
    """The engine's own user in the CT (ENGINE_USER, group `gid`), made once."""
    argv = ["sh", "-c", _ENSURE_USER, "sh", ENGINE_USER, str(int(gid))]
    _run(t, vmid, argv, f"creating the engine's user {ENGINE_USER}")


def restart_service(t: Transport, vmid: int | str) -> Outcome:
    """Restart the engine service (start it when it is down), with the unit already installed."""
    manager = service_manager(t, vmid)
    manager.restart()
    return Outcome(True, f"restarted ({manager.kind})")


# -- the API key -------------------------------------------------------------------------------
API_KEY = re.compile(r"[A-Za-z0-9._~+/=:@-]{1,4096}")  # token68 and a few more; no quoting needed


def parse_api_key(value: str) -> str:
    """The operator's DDOPS_API_KEY, checked; ValueError says what is wrong without echoing it."""
    if not API_KEY.fullmatch(value):
        raise ValueError(
            f"{API_KEY_ENV} must be 1-4096 characters of letters, digits and ._~+/=:@- "
            f"(got {len(value)} characters{', some not allowed' if value else ''})"
        )
    return value


@dataclass(frozen=True)
class KeyChange:
    """What provision must do to the CT's API key file: the finding and the plan, in words."""

    evidence: str
    action: str  # "write" | "generate" | "remove"


def api_key_change(
    t: Transport, vmid: int | str, wanted: str | None, remove: bool
) -> KeyChange | None:
    """None when the CT's key file is as provision wants it: the operator's key when one is
    given (compared by hash inside the CT, never read back), any key when none is given, a file
    saying there is no key when `remove`."""
    present = _installed_key_digest(t, validate_vmid(vmid))
    if remove:
        if present:
            return KeyChange(f"an API key is installed in {ENV_FILE}", "remove")
        return KeyChange(f"no {ENV_FILE}", "remove") if present is None else None
    if wanted is not None:
        if present == hashlib.sha256(_env_file_text(wanted).encode()).hexdigest():
            return None
        words = "differs from" if present else "is not yet"
        return KeyChange(f"the installed API key {words} {API_KEY_ENV}", "write")
    return None if present else KeyChange(f"no API key in {ENV_FILE}", "generate")


def apply_api_key(t: Transport, vmid: int | str, change: KeyChange, wanted: str | None) -> str:
    """Carry out `change` (the key on stdin, 0600 from its first byte); what was done, in words."""
    vmid = validate_vmid(vmid)
    argv = ["sh", "-c", _WRITE_PRIVATE, "sh", ENV_FILE]
    if change.action == "remove":
        _run(t, vmid, argv, f"writing {ENV_FILE}", input=NO_KEY_TEXT)
        return f"removed the API key from {ENV_FILE}: the engine serves without authentication"
    key = wanted if change.action == "write" else secrets.token_urlsafe(32)
    _run(t, vmid, argv, f"writing {ENV_FILE}", input=_env_file_text(key))
    if change.action == "write":
        return f"wrote {API_KEY_ENV} to {ENV_FILE} (0600)"
    return (
        f"generated an API key into {ENV_FILE} (0600); read it with "
        f"`pct exec {vmid} -- cat {ENV_FILE}` on the host"
    )


def installed_api_key(t: Transport, vmid: int | str) -> str | None:
    """The key the CT's engine requires (for ddops' own clients, e.g. the bench); never logged."""
    text = _read_ct_file(t, validate_vmid(vmid), ENV_FILE) or ""
    for line in text.splitlines():
        if line.startswith(f"{API_KEY_ENV}="):
            return line.split("=", 1)[1].strip() or None
    return None


def _installed_key_digest(t: Transport, vmid: str) -> str | None:
    """The key file's sha256 when it holds a key; "" when it holds none; None without a file."""
    r = ct_exec(t, vmid, ["sh", "-c", _KEY_DIGEST, "sh", ENV_FILE, API_KEY_ENV])
    return r.stdout.strip() if r.ok else None


# Prints the file's sha256 when it sets "$2", an empty line when it does not; fails without it.
_KEY_DIGEST = """[ -f "$1" ] || exit 1
if grep -q "^$2=" "$1"; then sha256sum "$1" | cut -d ' ' -f 1; else echo; fi
"""


def _env_file_text(api_key: str) -> str:
    return f"{API_KEY_ENV}={api_key}\n"


# Writes stdin to "$1" with mode 0600 from the first byte (umask), replacing it atomically.
_WRITE_PRIVATE = 'umask 077 && mkdir -p "${1%/*}" && cat > "$1.tmp" && mv -f "$1.tmp" "$1"'


# -- health ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineHealth:
    """The in-CT health probe's verdict: a problem in one line, or whether a key is required."""

    problem: str | None
    key_required: bool = False


def engine_health(
    t: Transport, vmid: int | str, engine: EngineSpec, timeout: float = 30.0, wait: float = 0.0
) -> EngineHealth:
    """From inside the CT (ops/agents/engine_probe.py, stdlib only, from stdin: nothing written;
    `-I -S`: no site-packages to import first): /ready answers 200 (an engine still starting is
    waited for up to `wait` s), a 4-token completion comes back with text and usage, and the
    engine requires the installed key; else the problem in one line ("engine in CT 200: /ready
    answered 503 (loading)")."""
    vmid = validate_vmid(vmid)
    argv = [engine.python, "-I", "-S", "-", str(engine.port), ENV_FILE, f"{timeout:g}", API_KEY_ENV]
    argv += ["--wait", f"{wait:g}"] if wait > 0 else []
    r = ct_exec(t, vmid, argv, input=ENGINE_PROBE.read_text(), timeout=timeout * 3 + wait + 30)
    if not r.ok:
        return EngineHealth(f"engine in CT {vmid}: {_last_words(r, stdout_first=True)}")
    return EngineHealth(None, bool(json.loads(r.stdout).get("key_required")))


def engine_health_problem(
    t: Transport, vmid: int | str, engine: EngineSpec, timeout: float = 30.0
) -> str | None:
    """None when the engine is healthy (see `engine_health`), else one line saying why not."""
    return engine_health(t, vmid, engine, timeout).problem


def wait_ready(
    t: Transport,
    vmid: int | str,
    engine: EngineSpec,
    timeout: float,
    manager: ServiceManager | None = None,
) -> None:
    """Return once the engine is healthy; DdopsError naming the CT, with the engine's last log
    lines, when the service stops or the engine exits meanwhile, or after `timeout` seconds.
    The probe itself waits in the CT for an engine still starting, WAIT_SLICE_S at a time (its
    asks 0.05 s apart at first): one `pct exec` a slice, then the service's state."""
    manager = manager or service_manager(t, vmid)
    exits_before = manager.state().exits
    deadline = time.monotonic() + timeout
    while True:
        asked = time.monotonic()
        wait = max(0.0, min(WAIT_SLICE_S, deadline - asked))
        health = engine_health(t, manager.vmid, engine, timeout=min(30.0, timeout), wait=wait)
        if health.problem is None:
            return
        state = manager.state()
        if not state.running or state.exits > exits_before:
            cause = f"the engine stopped before it was ready ({manager.kind}: {state.words})"
        elif time.monotonic() >= deadline:
            cause = f"engine not ready after {timeout:g} s: {health.problem}"
        else:  # an answer that is not "starting" came at once: ask again after a pause
            time.sleep(max(0.0, POLL_S - (time.monotonic() - asked)))
            continue
        log = manager.log_tail()
        raise DdopsError(f"CT {manager.vmid}", f"{cause}; its last log lines follow", log)
