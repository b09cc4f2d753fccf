"""ops/deploy.py on a simulated Proxmox host: the engine as a service in a real LXC container.

CT 200 (shared by the module) gets a tiny random Qwen3 staged into its /dev/shm from a local hub,
then the engine, run by the ddops supervisor (busybox CTs have no systemd), with the test's own
Python as the engine's interpreter (it is bound into the CT read-only). CT 201 is the scratch CT
for what must not touch CT 200: dry-run from nothing and a bad model directory.
Model load is the cost (torch import in the CT: ~10 s idle, much more on a loaded machine).

    python -m pytest -q tests/test_deploy.py
"""

from __future__ import annotations

import dataclasses
import json
import sys

import httpx
import pytest

from ops import deploy, supervise
from ops.errors import DdopsError
from ops.inventory import EngineSpec, ModelRef
from ops.pve import ct_exec
from ops.sim.host import destroy_host, init_host
from ops.sim.hub import LocalHub
from ops.staging import stage_model
from ops.transport import LocalTransport
from tests.helpers.engine_server import free_port
from tests.helpers.tiny_qwen3 import save_tiny_qwen3

pytestmark = pytest.mark.lxc

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
    """A sim host with CT 200 (the tiny model staged into its /dev/shm) and CT 201, running."""
    with pytest.MonkeyPatch.context() as env:
        for name in HOST_ONLY_ENV:
            env.delenv(name, raising=False)
        yield from _sim_host_with_model(tmp_path_factory.mktemp("deploy"))


def _sim_host_with_model(tmp):
    save_tiny_qwen3(tmp / "hub" / "ddops" / "tiny-qwen3", max_position_embeddings=256)
    init_host(tmp / "pve", gpus=1, containers="lxc")
    t = LocalTransport(sysroot=str(tmp / "pve"))
    try:
        for vmid in (CT, SCRATCH_CT):
            t.write_file(f"/etc/pve/lxc/{vmid}.conf", CT_CONF.format(vmid=vmid), backup=False)
            t.run(["pct", "start", str(vmid)]).check(f"CT {vmid}")
        with LocalHub(tmp / "hub") as hub:
            stage_model(t, CT, MODEL, python=sys.executable, endpoint=hub.url)
        yield t
    finally:
        destroy_host(tmp / "pve")


@pytest.fixture(scope="module")
def engine():
    return EngineSpec(method="ar", port=free_port(), max_model_len=128, python=sys.executable)


@pytest.fixture(scope="module")
def deployed(host, engine):
    """CT 200's engine deployed from nothing; the first Outcome."""
    outcome = deploy.ensure_service(host, CT, engine, MODEL_DIR, None, dry_run=False)
    deploy.wait_ready(host, CT, engine, timeout=READY_TIMEOUT_S)
    return outcome


def supervisor_status(t, vmid: int = CT) -> supervise.Status:
    r = ct_exec(t, vmid, ["cat", supervise.STATUS_FILE]).check("status")
    return supervise.Status(**json.loads(r.stdout))


def ct_file(t, path: str, vmid: int = CT) -> str | None:
    r = ct_exec(t, vmid, ["cat", path])
    return r.stdout if r.ok else None


def completion(engine, headers=None) -> httpx.Response:
    """The engine from outside the CT: the sim's CTs share the host's network namespace."""
    body = {"prompt": "hello", "max_tokens": 2}
    url = f"http://127.0.0.1:{engine.port}/v1/completions"
    return httpx.post(url, json=body, headers=headers or {}, timeout=60)


# -- install -----------------------------------------------------------------------------------
def test_the_sim_engine_python_needs_no_install(host, engine):
    assert deploy.engine_problem(host, CT, engine) is None
    outcome = deploy.install_engine(host, CT, engine)
    assert not outcome.changed and sys.executable in outcome.detail


def test_a_missing_engine_python_is_named_and_not_installed_outside_a_venv(host):
    missing = EngineSpec(python="/usr/bin/no-such-python")
    assert deploy.engine_problem(host, CT, missing) == (
        f"engine python /usr/bin/no-such-python in CT {CT}: not found"
    )
    with pytest.raises(DdopsError, match="installs the engine only into a venv it owns"):
        deploy.install_engine(host, CT, missing)


# -- the service from nothing, then idempotent ---------------------------------------------------
def test_dry_run_from_nothing_shows_the_unit_and_changes_nothing(host, engine):
    outcome = deploy.ensure_service(host, SCRATCH_CT, engine, MODEL_DIR, None, dry_run=True)
    assert outcome.changed
    assert outcome.detail == "would write the unit, start the service (ddops supervisor)"
    assert f"+ExecStart={sys.executable} -m engine serve --model {MODEL_DIR}" in outcome.diff
    assert ct_file(host, deploy.SUPERVISED_UNIT, SCRATCH_CT) is None
    assert ct_file(host, supervise.PIDFILE, SCRATCH_CT) is None
    assert deploy.service_problem(host, SCRATCH_CT) == (
        f"engine service in CT {SCRATCH_CT} is not running (ddops supervisor: no supervisor)"
    )


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


def test_a_second_run_is_unchanged_and_rewrites_nothing(host, engine, deployed):
    stamp = ["stat", "-c", "%Y %i", deploy.SUPERVISED_UNIT]
    before = ct_exec(host, CT, stamp).stdout, supervisor_status(host)
    outcome = deploy.ensure_service(host, CT, engine, MODEL_DIR, None, dry_run=False)
    assert outcome == deploy.Outcome(False, "running (ddops supervisor)")
    assert (ct_exec(host, CT, stamp).stdout, supervisor_status(host)) == before


def test_dry_run_on_a_changed_budget_shows_the_diff_and_changes_nothing(host, engine, deployed):
    unit, status = ct_file(host, deploy.SUPERVISED_UNIT), supervisor_status(host)
    changed = dataclasses.replace(engine, budget=7)
    outcome = deploy.ensure_service(host, CT, changed, MODEL_DIR, None, dry_run=True)
    assert outcome.detail == "would write the unit, restart the service (ddops supervisor)"
    exec_lines = [line for line in outcome.diff.splitlines() if "ExecStart=" in line]
    assert [line[0] for line in exec_lines] == ["-", "+"]
    assert "--budget 15 " in exec_lines[0] and "--budget 7 " in exec_lines[1]
    assert (ct_file(host, deploy.SUPERVISED_UNIT), supervisor_status(host)) == (unit, status)


# -- failures and repairs ----------------------------------------------------------------------
def test_a_killed_engine_is_restarted_by_the_supervisor(host, engine, deployed):
    killed = supervisor_status(host)
    ct_exec(host, CT, ["kill", "-KILL", str(killed.engine_pid)]).check("kill")
    deploy.wait_ready(host, CT, engine, timeout=READY_TIMEOUT_S)
    now = supervisor_status(host)
    assert now.starts == killed.starts + 1 and now.last_exit == -9
    assert now.engine_pid not in (None, killed.engine_pid)
    assert deploy.service_problem(host, CT) is None


def test_the_api_key_reaches_the_engine_only_through_its_0600_file(
    host, engine, deployed, monkeypatch
):
    key = "sk-test-9c2e"
    monkeypatch.setenv(deploy.API_KEY_ENV, key)
    outcome = deploy.ensure_service(host, CT, engine, MODEL_DIR, None, dry_run=False)
    assert outcome.detail == (
        "did write the unit, write the API key to /etc/ddops/engine.env, "
        "restart the service (ddops supervisor)"
    )
    assert f"+EnvironmentFile={deploy.ENV_FILE}" in outcome.diff and key not in outcome.diff
    mode = ct_exec(host, CT, ["stat", "-c", "%a", deploy.ENV_FILE]).stdout.strip()
    assert mode == "600"
    deploy.wait_ready(host, CT, engine, timeout=READY_TIMEOUT_S)  # the probe sends the key
    assert completion(engine).status_code == 401
    assert completion(engine, {"Authorization": f"Bearer {key}"}).status_code == 200
    log = ct_exec(host, CT, ["cat", supervise.LOG_FILE]).stdout
    ps = ct_exec(host, CT, ["ps", "-o", "args"]).stdout
    assert key not in log and key not in ps
    assert not deploy.ensure_service(host, CT, engine, MODEL_DIR, None, dry_run=False).changed


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


def test_a_bad_model_dir_fails_with_the_engines_last_log_lines(host):
    engine = EngineSpec(method="ar", port=free_port(), python=sys.executable)
    missing = "/dev/shm/models/missing"
    deploy.ensure_service(host, SCRATCH_CT, engine, missing, None, dry_run=False)
    with pytest.raises(DdopsError) as failure:
        deploy.wait_ready(host, SCRATCH_CT, engine, timeout=READY_TIMEOUT_S)
    ct_exec(host, SCRATCH_CT, [sys.executable, "-m", "ops.supervise", "stop"]).check("stop")
    assert str(failure.value).startswith(
        f"CT {SCRATCH_CT}: the engine stopped before it was ready (ddops supervisor: "
    )
    assert str(failure.value).endswith("; its last log lines follow")
    assert f"No such file or directory: '{missing}/config.json'" in failure.value.detail
