"""ops/chain/deploy.py on a simulated Proxmox host: the engine as a service in a real LXC container.

CT 200 (shared by the module) gets a tiny random Qwen3 staged into its /dev/shm from a local hub,
then the engine, run by the ddops supervisor (busybox CTs have no systemd), with the test's own
Python as the engine's interpreter (it is bound into the CT read-only). CT 201 is the scratch CT
for what must not touch CT 200: dry-run from nothing and a bad model directory.
Model load is the cost (torch import in the CT: ~10 s idle, ~40 s on a loaded machine): the
tests that start an engine or import torch in a CT are marked slow (run with --slow).
The supervisor itself is tested on this machine with stand-in commands, and the systemd path
against a fake `pct` whose CT runs systemd (no such CT can run here).

    python -m pytest -q tests/integration/test_deploy.py            # ~40 s: supervisor, systemd path, dry-run
    python -m pytest -q tests/integration/test_deploy.py --slow     # + engines in real CTs: ~5 min on 2 busy cores
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ops.agents import supervise
from ops.chain import deploy
from ops.chain.stage_model import stage_models
from ops.errors import DdopsError
from ops.host.pve import ct_exec
from ops.host.transport import LocalTransport, Result, Transport
from ops.render import EngineUnit, render
from ops.sim.host import destroy_host, init_host
from ops.sim.hub import LocalHub
from ops.site.inventory import EngineSpec, ModelRef
from tests.helpers.engine_server import free_port
from tests.helpers.tiny_qwen3 import save_tiny_qwen3

CT, SCRATCH_CT = 200, 201
MODEL = ModelRef("ddops/tiny-qwen3", "main", "tiny")
MODEL_DIR = "/dev/shm/models/tiny"
READY_TIMEOUT_S = 240.0
CT_CONF = "arch: amd64\nhostname: llm{vmid}\nmemory: 4096\n"


# The sim's `pct exec` keeps the caller's environment; CA bundle paths of this machine do not
# exist inside the CTs, and Python's ssl module fails on them (even for a plain-HTTP hub).
HOST_ONLY_ENV = ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """A sim host with CT 200 and CT 201 running."""
    tmp = tmp_path_factory.mktemp("deploy")
    init_host(tmp / "pve", gpus=1, containers="lxc")
    t = LocalTransport(sysroot=str(tmp / "pve"))
    try:
        with pytest.MonkeyPatch.context() as env:
            for name in HOST_ONLY_ENV:
                env.delenv(name, raising=False)
            for vmid in (CT, SCRATCH_CT):
                t.write_file(f"/etc/pve/lxc/{vmid}.conf", CT_CONF.format(vmid=vmid), backup=False)
                t.run(["pct", "start", str(vmid)]).check(f"CT {vmid}")
                no_key = deploy.api_key_change(t, vmid, None, remove=True)  # the unit requires
                deploy.apply_api_key(t, vmid, no_key, None)  # its key file, keyless or not
            yield t
    finally:
        destroy_host(tmp / "pve")


@pytest.fixture(scope="module")
def staged(host, tmp_path_factory):
    """The sim host, with a tiny Qwen3 staged from a local hub into CT 200's /dev/shm."""
    hub_root = tmp_path_factory.mktemp("hub")
    save_tiny_qwen3(hub_root / "ddops" / "tiny-qwen3", max_position_embeddings=256)
    with LocalHub(hub_root) as hub:
        stage_models(host, CT, [MODEL], python=sys.executable, endpoint=hub.url)
    return host


@pytest.fixture(scope="module")
def engine():
    return EngineSpec(method="ar", port=free_port(), max_model_len=128, python=sys.executable)


@pytest.fixture(scope="module")
def deployed(staged, engine):
    """CT 200's engine deployed from nothing; the first Outcome."""
    outcome = deploy.ensure_service(
        staged, deploy.EngineDeployment(CT, engine, MODEL_DIR, None), dry_run=False
    )
    deploy.wait_ready(staged, CT, engine, timeout=READY_TIMEOUT_S)
    return outcome


def wait_until(probe, timeout: float = 60.0):
    """probe()'s first truthy value. What tests wait for here happens in other processes (the
    supervisor, a CT): there is no event to await, only their next state to read."""
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        assert time.monotonic() < deadline, f"still waiting after {timeout:g} s"
        time.sleep(0.05)
    return value


def supervisor_status(t, vmid: int = CT) -> supervise.Status:
    r = ct_exec(t, vmid, ["cat", supervise.STATUS_FILE]).check("status")
    return supervise.Status(**json.loads(r.stdout))


def ct_file(t, path: str, vmid: int = CT) -> str | None:
    r = ct_exec(t, vmid, ["cat", path])
    return r.stdout if r.ok else None


def completion(engine, headers=None) -> httpx.Response:
    """The engine from outside the CT: the sim's CTs share the host's network namespace."""
    body = {"prompt": "hello", "max_tokens": 2, "temperature": 0}  # greedy: sampling may draw eos
    url = f"http://127.0.0.1:{engine.port}/v1/completions"
    return httpx.post(url, json=body, headers=headers or {}, timeout=60)


# -- install -----------------------------------------------------------------------------------
@pytest.mark.lxc
@pytest.mark.slow
def test_the_sim_engine_python_needs_no_install(host, engine):
    assert deploy.engine_problem(host, CT, engine) is None
    outcome = deploy.install_engine(host, CT, engine)
    assert not outcome.changed and sys.executable in outcome.detail


@pytest.mark.lxc
def test_a_missing_engine_python_is_named_and_not_installed_outside_a_venv(host):
    missing = EngineSpec(python="/usr/bin/no-such-python")
    assert deploy.engine_problem(host, CT, missing) == (
        f"engine python /usr/bin/no-such-python in CT {CT}: not found"
    )
    with pytest.raises(DdopsError, match="installs the engine only into a venv it owns"):
        deploy.install_engine(host, CT, missing)


# -- the service from nothing, then idempotent ---------------------------------------------------
@pytest.mark.lxc
def test_dry_run_from_nothing_shows_the_unit_and_changes_nothing(host, engine):
    outcome = deploy.ensure_service(
        host, deploy.EngineDeployment(SCRATCH_CT, engine, MODEL_DIR, None), dry_run=True
    )
    assert outcome.changed
    assert outcome.detail == "would write the unit, start the service (ddops supervisor)"
    assert f"+ExecStart={sys.executable} -m engine serve --model {MODEL_DIR}" in outcome.diff
    assert ct_file(host, deploy.SUPERVISED_UNIT, SCRATCH_CT) is None
    assert ct_file(host, supervise.PIDFILE, SCRATCH_CT) is None
    assert deploy.service_problem(host, SCRATCH_CT) == (
        f"engine service in CT {SCRATCH_CT} is not running (ddops supervisor: no supervisor)"
    )


@pytest.mark.lxc
@pytest.mark.slow
def test_from_nothing_the_engine_runs_and_answers_a_generation(host, engine, deployed):
    assert deployed.changed
    assert deployed.detail == "did write the unit, start the service (ddops supervisor)"
    unit = ct_file(host, deploy.SUPERVISED_UNIT)
    assert "--device cpu" in unit and "--dtype float32" in unit  # "auto" on a sim host
    assert supervise.parse_unit(unit).argv[:4] == [sys.executable, "-m", "engine", "serve"]
    assert deploy.service_problem(host, CT) is None
    assert deploy.engine_health_problem(host, CT, engine) is None
    answer = completion(engine).json()
    assert answer["usage"]["completion_tokens"] == 2


@pytest.mark.lxc
@pytest.mark.slow
def test_a_second_run_is_unchanged_and_rewrites_nothing(host, engine, deployed):
    stamp = ["stat", "-c", "%Y %i", deploy.SUPERVISED_UNIT]
    before = ct_exec(host, CT, stamp).stdout, supervisor_status(host)
    outcome = deploy.ensure_service(
        host, deploy.EngineDeployment(CT, engine, MODEL_DIR, None), dry_run=False
    )
    assert outcome == deploy.Outcome(False, "running (ddops supervisor)")
    assert (ct_exec(host, CT, stamp).stdout, supervisor_status(host)) == before


@pytest.mark.lxc
@pytest.mark.slow
def test_dry_run_on_a_changed_budget_shows_the_diff_and_changes_nothing(host, engine, deployed):
    unit, status = ct_file(host, deploy.SUPERVISED_UNIT), supervisor_status(host)
    changed = dataclasses.replace(engine, budget=7)
    outcome = deploy.ensure_service(
        host, deploy.EngineDeployment(CT, changed, MODEL_DIR, None), dry_run=True
    )
    assert outcome.detail == "would write the unit, restart the service (ddops supervisor)"
    exec_lines = [line for line in outcome.diff.splitlines() if "ExecStart=" in line]
    assert [line[0] for line in exec_lines] == ["-", "+"]
    assert "--budget 15 " in exec_lines[0] and "--budget 7 " in exec_lines[1]
    assert (ct_file(host, deploy.SUPERVISED_UNIT), supervisor_status(host)) == (unit, status)


# -- failures and repairs ----------------------------------------------------------------------
@pytest.mark.lxc
@pytest.mark.slow
def test_a_killed_engine_is_restarted_by_the_supervisor(host, engine, deployed):
    killed = supervisor_status(host)
    ct_exec(host, CT, ["kill", "-KILL", str(killed.engine_pid)]).check("kill")
    wait_until(lambda: supervisor_status(host).exits > killed.exits)  # it saw the exit
    deploy.wait_ready(host, CT, engine, timeout=READY_TIMEOUT_S)
    now = supervisor_status(host)
    assert now.starts == killed.starts + 1 and now.last_exit == -9
    assert now.engine_pid not in (None, killed.engine_pid)
    assert deploy.service_problem(host, CT) is None


@pytest.mark.lxc
@pytest.mark.slow
def test_the_api_key_reaches_the_engine_only_through_its_0600_file(host, engine, deployed):
    key = "sk-test-9c2e"
    change = deploy.api_key_change(host, CT, key, remove=False)
    assert change == deploy.KeyChange("the installed API key is not yet DDOPS_API_KEY", "write")
    assert deploy.apply_api_key(host, CT, change, key) == (
        "wrote DDOPS_API_KEY to /etc/ddops/engine.env (0600)"
    )
    mode = ct_exec(host, CT, ["stat", "-c", "%a", deploy.ENV_FILE]).stdout.strip()
    assert mode == "600"
    deploy.restart_service(host, CT)
    deploy.wait_ready(host, CT, engine, timeout=READY_TIMEOUT_S)  # the probe sends the key
    assert deploy.engine_health(host, CT, engine) == deploy.EngineHealth(None, key_required=True)
    assert completion(engine).status_code == 401
    assert completion(engine, {"Authorization": f"Bearer {key}"}).status_code == 200
    log = ct_exec(host, CT, ["cat", supervise.LOG_FILE]).stdout
    ps = ct_exec(host, CT, ["ps", "-o", "args"]).stdout
    assert key not in log and key not in ps
    assert deploy.api_key_change(host, CT, key, remove=False) is None
    assert deploy.installed_api_key(host, CT) == key
    assert not deploy.ensure_service(
        host, deploy.EngineDeployment(CT, engine, MODEL_DIR, None), dry_run=False
    ).changed


@pytest.mark.lxc
@pytest.mark.slow
def test_a_gone_supervisor_is_reported_and_restart_service_recovers(host, engine, deployed):
    supervisor = ct_file(host, supervise.PIDFILE).strip()
    ct_exec(host, CT, ["kill", "-KILL", supervisor]).check("kill")
    assert deploy.service_problem(host, CT) == (
        f"engine service in CT {CT} is not running "
        "(ddops supervisor: no supervisor (its pidfile is stale))"
    )
    outcome = deploy.restart_service(host, CT)  # also stops the engine the supervisor left
    assert outcome == deploy.Outcome(True, "restarted (ddops supervisor)")
    deploy.wait_ready(host, CT, engine, timeout=READY_TIMEOUT_S)
    assert ct_file(host, supervise.PIDFILE).strip() != supervisor


@pytest.mark.lxc
@pytest.mark.slow
def test_a_bad_model_dir_fails_with_the_engines_last_log_lines(host):
    engine = EngineSpec(method="ar", port=free_port(), python=sys.executable)
    missing = "/dev/shm/models/missing"
    deploy.ensure_service(
        host, deploy.EngineDeployment(SCRATCH_CT, engine, missing, None), dry_run=False
    )
    with pytest.raises(DdopsError) as failure:
        deploy.wait_ready(host, SCRATCH_CT, engine, timeout=READY_TIMEOUT_S)
    ct_exec(host, SCRATCH_CT, [sys.executable, "-m", "ops.agents.supervise", "stop"]).check("stop")
    assert str(failure.value).startswith(
        f"CT {SCRATCH_CT}: the engine stopped before it was ready (ddops supervisor: "
    )
    assert str(failure.value).endswith("; its last log lines follow")
    assert f"No such file or directory: '{missing}/config.json'" in failure.value.detail


# -- the supervisor on this machine, with stand-in engines ---------------------------------------
def stand_in_unit(tmp_path, script: str, restart_sec: float = 0.2) -> Path:
    """A unit like the engine's whose ExecStart runs `script` in Python; its argv carries
    "engine serve", as the real engine's does (that is how `stop` recognises leftovers)."""
    (tmp_path / "engine.env").write_text('# the key file\nDDOPS_API_KEY="k-123"\n')
    unit = tmp_path / "stand-in.service"
    unit.write_text(
        "[Unit]\nDescription=stand-in\n\n[Service]\nEnvironment=GREETING=hi\n"
        f"EnvironmentFile={tmp_path / 'engine.env'}\n"
        f"ExecStart={sys.executable} -c {json.dumps(script)} engine serve\n"
        f"RestartSec={restart_sec}\n"
    )
    return unit


class LocalSupervisor:
    """`python -m ops.agents.supervise` on this machine, with its files in a tmp dir."""

    def __init__(self, tmp_path: Path) -> None:
        self.pidfile = tmp_path / "run" / "engine.pid"
        self.status_file = tmp_path / "run" / "engine.status"
        self.log = tmp_path / "engine.log"

    def call(self, *args: str) -> str:
        argv = [sys.executable, "-m", "ops.agents.supervise", *args, "--pidfile", str(self.pidfile)]
        return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()

    def start(self, unit: Path) -> int:
        files = ["--status-file", str(self.status_file), "--log", str(self.log)]
        return int(self.call("start", "--unit", str(unit), *files))

    def status(self) -> supervise.Status:
        return supervise.Status(**json.loads(self.status_file.read_text()))

    def wait_for(self, condition) -> supervise.Status:
        """The status once `condition(status)` holds."""

        def satisfied() -> supervise.Status | None:
            status = self.status()
            return status if condition(status) else None

        return wait_until(satisfied)

    def wait_for_log(self, line: str, count: int) -> None:
        self.wait_for(lambda _: self.log.read_text().count(line) >= count)


@pytest.fixture
def supervisor(tmp_path):
    local = LocalSupervisor(tmp_path)
    yield local
    with contextlib.suppress(subprocess.CalledProcessError):
        local.call("stop")


# Prints what reached its environment, then sleeps like a serving engine.
SLEEPER = (
    "import os, time; env = os.environ; "
    "print(env['GREETING'], env['DDOPS_API_KEY'], 'CALLERS_SECRET' in env, flush=True); "
    "time.sleep(600)"
)
SLEEPER_SAYS = "hi k-123 False\n"


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie does not: it waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_parse_unit_reads_back_the_rendered_engine_unit():
    unit = EngineUnit(
        python="/opt/my venv/bin/python",
        model="/models/50% done",
        port=8123,
        method="ar",
        env_file="/etc/ddops/engine.env",
        cuda_visible_devices="0,1",
    )
    command = supervise.parse_unit(render(unit))
    assert command.argv[:6] == [
        "/opt/my venv/bin/python",
        "-m",
        "engine",
        "serve",
        "--model",
        "/models/50% done",
    ]
    assert command.argv[-4:] == ["--dtype", "bfloat16", "--device", "cuda"]
    assert command.environment == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "HOME": "/var/cache/ddops-engine",
    }
    assert command.environment_files == ["/etc/ddops/engine.env"]  # required: never without it
    assert command.restart_sec == 5.0
    assert (command.user, command.group, command.umask) == ("ddops-engine", "44", 0o077)
    assert command.no_new_privileges and command.cache_directory == "ddops-engine"
    assert "ProtectSystem=strict" in command.unapplied  # only systemd's namespaces give it
    with pytest.raises(ValueError, match="no ExecStart"):
        supervise.parse_unit("[Unit]\nExecStart=/bin/true\n")


@pytest.mark.parametrize(
    "line",
    [
        'EnvironmentFile=-"/etc/ddops/engine.env"',  # what the unit template wrote before
        "EnvironmentFile=etc/ddops/engine.env",
        "EnvironmentFile=/etc/dd ops.env",
        "AmbientCapabilities=CAP_NET_BIND_SERVICE",
    ],
)
def test_parse_unit_refuses_what_systemd_would_not_run_as_written(line):
    """systemd reads EnvironmentFile= raw: a quoted or relative path is ignored (and a "-" hides
    that: the engine would start without its key). The parser took the quotes away and ran it."""
    with pytest.raises(ValueError, match="EnvironmentFile=|AmbientCapabilities="):
        supervise.parse_unit(f"[Service]\n{line}\nExecStart=/bin/true\n")


SYSTEM_PYTHON = "/usr/bin/python3"  # one that another user may run (this venv's may be under /root)


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
    reason="dropping to another user needs root, and a Python that user may run",
)
def test_the_supervisor_runs_the_engine_as_the_units_user_without_privileges(supervisor, tmp_path):
    """User=, Group=, NoNewPrivileges=, an empty bounding set, CacheDirectory=: as systemd would."""
    script = (
        "import os; s = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines() "
        "if ':\\t' in l); print('ids', os.getuid(), os.getgid(), os.getgroups(), s['NoNewPrivs'], "
        "s['CapBnd'], s['CapEff'], flush=True); import time; time.sleep(600)"
    )
    unit = stand_in_unit(tmp_path, script)
    unit.write_text(
        unit.read_text()
        .replace(f"ExecStart={sys.executable} ", f"ExecStart={SYSTEM_PYTHON} ")
        .replace(
            "[Service]\n",
            "[Service]\nUser=nobody\nGroup=65534\nNoNewPrivileges=yes\nUMask=0077\n"
            f"CacheDirectory=ddops-test-{tmp_path.name}\nProtectSystem=strict\n",
        )
    )
    supervisor.start(unit)
    supervisor.wait_for_log("ids ", 1)
    said = next(x for x in supervisor.log.read_text().splitlines() if x.startswith("ids "))
    assert said == "ids 65534 65534 [] 1 0000000000000000 0000000000000000"
    log = supervisor.log.read_text()
    assert "not applied without systemd: ProtectSystem=strict" in log
    cache = Path("/var/cache") / f"ddops-test-{tmp_path.name}"
    assert cache.stat().st_uid == 65534
    supervisor.call("stop")
    cache.rmdir()


def test_supervisor_runs_the_unit_restarts_a_killed_engine_and_stops_the_group(
    supervisor, tmp_path, monkeypatch
):
    monkeypatch.setenv("CALLERS_SECRET", "not-for-the-engine")
    unit = stand_in_unit(tmp_path, SLEEPER)
    pid = supervisor.start(unit)
    assert supervisor.start(unit) == pid  # already running: the same supervisor
    first = supervisor.wait_for(lambda s: s.engine_pid is not None)
    supervisor.wait_for_log(SLEEPER_SAYS, 1)
    os.kill(first.engine_pid, signal.SIGKILL)
    second = supervisor.wait_for(lambda s: s.starts == 2)
    assert second.last_exit == -signal.SIGKILL and second.engine_pid != first.engine_pid
    supervisor.wait_for_log(SLEEPER_SAYS, 2)
    assert supervisor.call("stop") == "stopped"
    assert not alive(pid) and not alive(second.engine_pid)
    assert not supervisor.pidfile.exists()
    log = supervisor.log.read_text()
    assert log.count(SLEEPER_SAYS) == 2  # Environment=, EnvironmentFile=; not the caller's env
    assert "engine exited with -9; restarting in 0.2 s" in log
    assert supervisor.call("stop") == "not running"


def test_supervisor_backs_off_on_failures_and_ends_on_a_clean_exit(supervisor, tmp_path):
    counter = tmp_path / "runs"
    script = (
        f"import pathlib, sys; p = pathlib.Path({str(counter)!r}); "
        "n = int(p.read_text()) + 1 if p.exists() else 1; p.write_text(str(n)); "
        "sys.exit(0 if n == 3 else 3)"
    )
    pid = supervisor.start(stand_in_unit(tmp_path, script, restart_sec=0.1))
    status = supervisor.wait_for(lambda s: not alive(pid))  # it ends by itself
    assert (status.starts, status.exits, status.last_exit) == (3, 3, 0)
    assert not supervisor.pidfile.exists()
    log = supervisor.log.read_text()
    assert (
        "exited with 3; restarting in 0.1 s" in log and "exited with 3; restarting in 0.2 s" in log
    )
    assert log.endswith("engine exited with 0; supervisor ends\n")


def test_a_new_supervisor_first_stops_the_engine_a_killed_one_left(supervisor, tmp_path):
    unit = stand_in_unit(tmp_path, SLEEPER)
    old = supervisor.start(unit)
    orphan = supervisor.wait_for(lambda s: s.engine_pid is not None).engine_pid
    os.kill(old, signal.SIGKILL)
    supervisor.wait_for(lambda s: not alive(old))
    assert alive(orphan)
    assert supervisor.start(unit) != old
    assert not alive(orphan)
    assert supervisor.wait_for(lambda s: s.engine_pid is not None).engine_pid != orphan


# -- a CT that runs systemd, on a real (non-sim) host: a fake `pct` -------------------------------
class SystemdCtHost(Transport):
    """A Proxmox host (no sysroot: not a simulation) whose CT 200 runs systemd, faked at the
    `pct exec` / `pct push` level: CT files in a dict, systemctl calls recorded."""

    def __init__(self, engine_installed: bool = True) -> None:
        super().__init__("fake-pve")
        self.host_files: dict[str, bytes] = {}
        self.ct_files: dict[str, bytes] = {deploy.ENV_FILE: deploy.NO_KEY_TEXT.encode()}
        self.systemctl: list[list[str]] = []
        self.ct_commands: list[list[str]] = []
        self.engine_installed = engine_installed
        self.users: dict[str, int] = {}  # made by the engine-user script: name -> gid
        self.unit_state = ("inactive", "dead", 0)  # ActiveState, SubState, NRestarts

    def run(self, argv, *, timeout=60.0, input=None, env=None) -> Result:
        argv = tuple(argv)
        if argv[:2] == ("pct", "push"):
            self.ct_files[argv[4]] = self.host_files[argv[3]]
            return Result(argv, 0, "", "")
        assert argv[:2] == ("pct", "exec") and argv[3] == "--", argv
        rc, out = self.exec_in_ct(list(argv[4:]), input)
        if rc == 0:
            return Result(argv, rc, out, "")
        return Result(argv, rc, "", out or f"{argv[4]}: failed")  # a failure's words: stderr

    def exec_in_ct(self, cmd: list[str], stdin: str | None) -> tuple[int, str]:
        self.ct_commands.append(cmd)
        match cmd:
            case ["test", "-d", "/run/systemd/system"] | ["mkdir", "-p", _]:
                return 0, ""
            case ["cat", path]:
                return (0, self.ct_files[path].decode()) if path in self.ct_files else (1, "")
            case ["sh", "-c", deploy._KEY_DIGEST, "sh", path, variable]:
                if path not in self.ct_files:
                    return 1, ""
                data = self.ct_files[path]
                has_key = any(x.startswith(f"{variable}=") for x in data.decode().splitlines())
                return 0, (hashlib.sha256(data).hexdigest() if has_key else "") + "\n"
            case ["sh", "-c", deploy._ENSURE_USER, "sh", user, gid]:
                self.users[user] = int(gid)
                return 0, ""
            case ["sh", "-c", deploy._WRITE_PRIVATE, "sh", path]:
                self.ct_files[path] = stdin.encode()
                return 0, ""
            case ["systemctl", "show", *_]:
                active, sub, restarts = self.unit_state
                return (
                    0,
                    f"ActiveState={active}\nSubState={sub}\nNRestarts={restarts}\nExecMainStatus=1\n",
                )
            case ["systemctl", *action]:
                self.systemctl.append(action)
                self.unit_state = ("active", "running", 0)
                return 0, ""
            case [_, "-c", deploy.IMPORT_CHECK]:
                if self.engine_installed:
                    return 0, importlib.metadata.version("ddops") + "\n"
                return 1, "ModuleNotFoundError: No module named 'engine'\n"
            case ["sh", "-c", deploy._PATH_KIND, "sh", _]:
                return 0, "absent\n"
            case ["python3", "-m", "venv", _]:
                return 0, ""
            case [_, "-m", "pip", "install", "--upgrade", _]:
                self.engine_installed = True
                return 0, ""
        return 1, ""

    def _read(self, real_path: str) -> bytes:
        return self.host_files[real_path]

    def _write_atomic(self, real_path: str, data: bytes, mode: int) -> None:
        self.host_files[real_path] = data

    def _stat_mode(self, real_path: str) -> int | None:
        return 0o644 if real_path in self.host_files else None


REAL_ENGINE = EngineSpec(
    method="ddtree", budget=15, port=8000
)  # python: /opt/ddops/venv/bin/python
TARGET, DRAFT = "/dev/shm/models/qwen3.6-27b", "/dev/shm/models/qwen3.6-27b-dflash"


def test_systemd_ct_gets_the_unit_enabled_and_started_then_nothing_changes():
    t = SystemdCtHost()
    outcome = deploy.ensure_service(
        t, deploy.EngineDeployment(CT, REAL_ENGINE, TARGET, DRAFT), dry_run=False
    )
    assert outcome.detail == "did write the unit, start the service (systemd)"
    unit = t.ct_files[EngineUnit.INSTALL_PATH].decode()
    assert f"+{unit.splitlines()[0]}" in outcome.diff
    assert "--method ddtree --budget 15 --dtype bfloat16 --device cuda" in unit  # "auto", real host
    assert "EnvironmentFile=/etc/ddops/engine.env\n" in unit  # required: never without its key
    assert "User=ddops-engine\nGroup=44\n" in unit
    assert t.users == {"ddops-engine": 44}  # made before the unit names it
    assert t.systemctl == [["daemon-reload"], ["enable", "--now", "ddops-engine.service"]]
    assert deploy.service_problem(t, CT) is None
    pushed = len(t.host_files)
    again = deploy.ensure_service(
        t, deploy.EngineDeployment(CT, REAL_ENGINE, TARGET, DRAFT), dry_run=False
    )
    assert again == deploy.Outcome(False, "running (systemd)")
    assert len(t.systemctl) == 2 and len(t.host_files) == pushed


def test_systemd_ct_changed_unit_dry_run_then_daemon_reload_and_restart():
    t = SystemdCtHost()
    deploy.ensure_service(t, deploy.EngineDeployment(CT, REAL_ENGINE, TARGET, DRAFT), dry_run=False)
    unit, changed = t.ct_files[EngineUnit.INSTALL_PATH], dataclasses.replace(REAL_ENGINE, budget=22)
    dry = deploy.ensure_service(
        t, deploy.EngineDeployment(CT, changed, TARGET, DRAFT), dry_run=True
    )
    assert dry.detail == "would write the unit, restart the service (systemd)"
    assert "--budget 22" in dry.diff
    assert t.ct_files[EngineUnit.INSTALL_PATH] == unit and len(t.systemctl) == 2
    deploy.ensure_service(t, deploy.EngineDeployment(CT, changed, TARGET, DRAFT), dry_run=False)
    assert t.systemctl[2:] == [["daemon-reload"], ["restart", "ddops-engine.service"]]
    assert b"--budget 22" in t.ct_files[EngineUnit.INSTALL_PATH]


def test_the_api_key_travels_on_stdin_and_is_compared_by_hash():
    t = SystemdCtHost()
    change = deploy.api_key_change(t, CT, "sk-live-0b7a", remove=False)
    assert change == deploy.KeyChange("the installed API key is not yet DDOPS_API_KEY", "write")
    done = deploy.apply_api_key(t, CT, change, "sk-live-0b7a")
    assert t.ct_files[deploy.ENV_FILE] == b"DDOPS_API_KEY=sk-live-0b7a\n"
    assert not any("sk-live-0b7a" in word for cmd in t.ct_commands for word in cmd)
    assert "sk-live-0b7a" not in done
    assert deploy.api_key_change(t, CT, "sk-live-0b7a", remove=False) is None
    assert deploy.api_key_change(t, CT, "sk-other", remove=False) == deploy.KeyChange(
        "the installed API key differs from DDOPS_API_KEY", "write"
    )


def test_without_a_key_the_installed_one_is_kept_and_only_removal_drops_it():
    t = SystemdCtHost()
    t.ct_files[deploy.ENV_FILE] = b"DDOPS_API_KEY=sk-kept\n"
    assert deploy.api_key_change(t, CT, None, remove=False) is None
    deploy.ensure_service(
        t, deploy.EngineDeployment(CT, REAL_ENGINE, TARGET, DRAFT), dry_run=False
    )  # unit + start
    assert t.ct_files[deploy.ENV_FILE] == b"DDOPS_API_KEY=sk-kept\n"
    change = deploy.api_key_change(t, CT, None, remove=True)
    assert change == deploy.KeyChange("an API key is installed in /etc/ddops/engine.env", "remove")
    assert deploy.apply_api_key(t, CT, change, None).startswith(
        "removed the API key from /etc/ddops/engine.env"
    )
    assert t.ct_files[deploy.ENV_FILE] == deploy.NO_KEY_TEXT.encode()  # the unit requires it
    assert deploy.api_key_change(t, CT, None, remove=True) is None
    assert deploy.installed_api_key(t, CT) is None
    assert deploy.api_key_change(t, CT, None, remove=False).action == "generate"


def test_removing_the_key_of_a_ct_that_has_no_key_file_writes_one_saying_so():
    t = SystemdCtHost()
    del t.ct_files[deploy.ENV_FILE]
    with pytest.raises(DdopsError, match="engine.env is missing and the engine's unit requires it"):
        deploy.ensure_service(
            t, deploy.EngineDeployment(CT, REAL_ENGINE, TARGET, DRAFT), dry_run=False
        )
    assert not t.systemctl
    change = deploy.api_key_change(t, CT, None, remove=True)
    assert change == deploy.KeyChange("no /etc/ddops/engine.env", "remove")
    deploy.apply_api_key(t, CT, change, None)
    assert t.ct_files[deploy.ENV_FILE] == deploy.NO_KEY_TEXT.encode()


def test_a_ct_without_a_key_gets_a_random_one_and_is_told_how_to_read_it():
    t = SystemdCtHost()
    change = deploy.api_key_change(t, CT, None, remove=False)
    assert change == deploy.KeyChange("no API key in /etc/ddops/engine.env", "generate")
    done = deploy.apply_api_key(t, CT, change, None)
    assert done == (
        "generated an API key into /etc/ddops/engine.env (0600); read it with "
        f"`pct exec {CT} -- cat /etc/ddops/engine.env` on the host"
    )
    key = deploy.installed_api_key(t, CT)
    assert deploy.API_KEY.fullmatch(key) and len(key) >= 32 and key not in done
    deploy.apply_api_key(t, CT, change, None)
    assert deploy.installed_api_key(t, CT) != key  # random each time


@pytest.mark.parametrize("bad", ["", "two words", "k\nDDOPS_X=1", 'k"', "x" * 4097])
def test_a_bad_operator_key_is_refused_without_echoing_it(bad):
    with pytest.raises(ValueError) as refused:
        deploy.parse_api_key(bad)
    assert str(refused.value).startswith("DDOPS_API_KEY must be 1-4096 characters")
    assert not bad or bad not in str(refused.value)


@pytest.mark.parametrize(
    "state, problem",
    [
        (("active", "running", 0), None),
        (
            ("activating", "auto-restart", 2),
            "is restarting the engine (systemd: activating (auto-restart), last exit status 1)",
        ),
        (("failed", "failed", 5), "is not running (systemd: failed (failed), last exit status 1)"),
    ],
)
def test_systemd_states_as_service_problems(state, problem):
    t = SystemdCtHost()
    t.unit_state = state
    expected = problem and f"engine service in CT {CT} {problem}"
    assert deploy.service_problem(t, CT) == expected


@pytest.mark.slow
def test_a_real_host_gets_a_venv_and_this_ddops_wheel_with_the_engine_extra():
    t = SystemdCtHost(engine_installed=False)
    outcome = deploy.install_engine(t, CT, REAL_ENGINE)
    assert outcome == deploy.Outcome(
        True, f"installed ddops[engine] {deploy.ddops_version()} into /opt/ddops/venv"
    )
    wheel = f"/var/lib/ddops/wheels/ddops-{deploy.ddops_version()}-py3-none-any.whl"
    assert t.ct_files[wheel][:2] == b"PK"  # a zip: the wheel built from this tree
    assert ["python3", "-m", "venv", "/opt/ddops/venv"] in t.ct_commands
    pip = [REAL_ENGINE.python, "-m", "pip", "install", "--upgrade", f"{wheel}[engine]"]
    assert pip in t.ct_commands
    assert not deploy.install_engine(t, CT, REAL_ENGINE).changed


def test_engine_problem_names_a_missing_engine_and_a_version_mismatch(monkeypatch):
    t = SystemdCtHost(engine_installed=False)
    python = REAL_ENGINE.python
    assert deploy.engine_problem(t, CT, REAL_ENGINE) == (
        f"engine python {python} in CT {CT}: ModuleNotFoundError: No module named 'engine'"
    )
    t.engine_installed = True
    monkeypatch.setattr(deploy, "ddops_version", lambda: "9.9.9")
    assert deploy.engine_problem(t, CT, REAL_ENGINE) == (
        f"engine python {python} in CT {CT}: has ddops {importlib.metadata.version('ddops')}, "
        "this is ddops 9.9.9"
    )


def test_the_unit_on_a_gpu_host_sees_the_cts_gpus_and_tp():
    from ops.host.transport import LocalTransport
    from ops.render import render

    engine = EngineSpec(tp=2, python="/opt/ddops/venv/bin/python")
    unit = render(
        deploy.engine_unit(
            LocalTransport(), deploy.EngineDeployment(CT, engine, "/dev/shm/models/t", "/d", 2)
        )
    )
    assert "Environment=CUDA_VISIBLE_DEVICES=0,1" in unit
    assert " --tp 2 " in unit and "--device cuda" in unit and "--dtype bfloat16" in unit
    sim = render(
        deploy.engine_unit(
            LocalTransport(sysroot="/tmp/x"), deploy.EngineDeployment(CT, engine, "/m", "/d", 2)
        )
    )
    assert "CUDA_VISIBLE_DEVICES" not in sim and "--device cpu" in sim
