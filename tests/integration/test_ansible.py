"""The playbooks through ansible-runner on two sim hosts: one local, one over real SSH on loopback.

    python -m pytest -q tests/integration/test_ansible.py            # inventories and event handling
    python -m pytest -q --slow tests/integration/test_ansible.py     # + real playbook runs (each 30-90 s here)

The slow ones: `ddops provision --via ansible --dry-run` from nothing plans and changes nothing;
the playbook applies (changed), then applies again (unchanged), and the CT config and boot units
it wrote equal, byte for byte, what the CLI path writes on twin hosts from the same inventory;
a host whose CT cannot be served fails with the CT named while the other host goes on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ops.ansible import (
    PLAYBOOKS,
    PlaybookRun,
    bench_args,
    connection_vars,
    run_playbook,
    search_path,
    site_inventory,
    with_local_connections,
)
from ops.bench.matrix import AgenticShape, BenchConfig, Slo, parse_methods
from ops.chain.checks import Policy, chain_for
from ops.chain.deploy import SUPERVISED_UNIT
from ops.chain.runner import contexts
from ops.chain.setup import boot_specs
from ops.cli import cli
from ops.host.kernels import PIN_RECORD
from ops.host.wheel import built_wheel, ddops_version
from ops.resources import playbooks_dir
from ops.sim.host import destroy_host, init_host, reboot_host
from ops.sim.hub import LocalHub
from ops.site.inventory import parse_site
from ops.site.selection import open_site
from tests.helpers.site import inventory_document, run_ddops, sim_site

pytestmark = pytest.mark.ansible

LOCAL, REMOTE = "pve-local", "pve-ssh"
VMIDS = {LOCAL: 200, REMOTE: 201}  # distinct: both hosts' LXC containers live on this machine
BOOT_UNITS = [spec.INSTALL_PATH for spec in boot_specs((0,), (200,), PIN_RECORD)]


# -- fast: inventories and events ----------------------------------------------------------------


@pytest.mark.parametrize("playbook", sorted(PLAYBOOKS.values()))
def test_every_playbook_and_task_file_parses(playbook, tmp_path):
    inventory = tmp_path / "inventory.yml"
    inventory.write_text("all:\n  hosts:\n    h:\n      ansible_connection: local\n")
    ansible = shutil.which("ansible-playbook", path=search_path())  # as ops runs it
    assert ansible is not None
    argv = [ansible, "-i", str(inventory), str(playbooks_dir() / playbook), "--syntax-check"]
    checked = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_site_inventory_round_trips_through_the_cli_reader(tmp_path):
    (tmp_path / "etc/pve").mkdir(parents=True)  # enough of a sim root for its target to parse
    document = inventory_document(tmp_path, "http://127.0.0.1:9", vmid=200, gpus=[0, 1])
    document["all"]["hosts"]["remote"] = {
        "ddops_target": "ssh://root@192.0.2.7:2222",
        "ddops_containers": [{"vmid": 300}],
    }
    site = parse_site(document)
    written = site_inventory(site)
    assert parse_site(yaml.safe_load(yaml.safe_dump(written))) == site
    local, remote = (written["all"]["hosts"][name] for name in ("pve", "remote"))
    assert local["ansible_connection"] == "local"
    assert local["ansible_python_interpreter"] == sys.executable
    assert remote | connection_vars("ssh://root@192.0.2.7:2222") == remote
    assert (remote["ansible_host"], remote["ansible_port"]) == ("192.0.2.7", 2222)


def test_user_inventory_gets_local_connections_for_sim_hosts_only_and_keeps_its_own_vars():
    document = {
        "all": {
            "hosts": {
                "sim": {"ddops_target": "local", "ansible_python_interpreter": "/opt/x/python"},
                "real": {"ansible_host": "192.0.2.8"},
            }
        }
    }
    changed = with_local_connections(document)
    assert changed["all"]["hosts"]["sim"] == {
        "ddops_target": "local",
        "ansible_python_interpreter": "/opt/x/python",
        "ansible_connection": "local",
    }
    assert changed["all"]["hosts"]["real"] == {"ansible_host": "192.0.2.8"}
    assert "ansible_connection" not in document["all"]["hosts"]["sim"]  # the input is not edited


def test_bench_args_give_each_host_the_same_matrix():
    from ops.commands.bench import bench_command, bench_config

    config = BenchConfig(
        methods=parse_methods("ar,ddtree:7,linear"),
        lengths=(16, 32),
        scenarios=("decode", "long"),
        repeats=2,
        warmup=0,
        agentic=AgenticShape(context=64, turns=2),
        max_repeats=5,
        time_budget_s=30.0,
        concurrency=(1, 4),
        requests_per_client=2,
        request_rate=1.5,
        seed=7,
        slo=Slo(ttft_s=2.0, tpot_s=0.1),
    )
    params = bench_command.make_context("bench", [*bench_args(config), "--ct", "200"]).params
    assert bench_config(params) == config


def test_bench_via_ansible_is_for_the_sites_cts_not_a_url():
    result = CliRunner().invoke(cli, ["bench", "--url", "http://127.0.0.1:9", "--via", "ansible"])
    assert result.exit_code == 2
    assert "--via ansible benches the site's CTs (--ct), not a --url" in result.output


def _event(kind: str, host: str, task: str, action: str, res: dict) -> dict:
    data = {"host": host, "task": task, "task_action": action, "res": res}
    return {"event": kind, "event_data": data}


def _check_item(vmid: int, key: str, status: str, evidence: str = "") -> dict:
    return {
        "vmid": vmid,
        "key": key,
        "title": key,
        "status": status,
        "seconds": 0.5,
        "evidence": evidence,
        "action": "",
        "diff": "",
    }


def test_the_bench_module_fetches_the_plots_with_the_reports(monkeypatch):
    """The role's fetch brings back every file in report_files: the PNG plots too (they had
    stayed on the host; only the markdown, CSV and JSON came back)."""
    import importlib.util

    role = playbooks_dir() / "roles" / "ddops_chain"
    utils = importlib.util.spec_from_file_location(
        "ansible.module_utils.ddops_host", role / "module_utils" / "ddops_host.py"
    )
    monkeypatch.setitem(sys.modules, utils.name, importlib.util.module_from_spec(utils))
    utils.loader.exec_module(sys.modules[utils.name])
    spec = importlib.util.spec_from_file_location(
        "_ddops_bench", role / "library" / "ddops_bench.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run = "/root/.config/ddops/results/R"
    plots = [f"{run}/plots/throughput_by_concurrency.png", f"{run}/plots/latency_by_throughput.png"]
    files = {"markdown": f"{run}/report.md", "csv": f"{run}/results.csv",
             "json": f"{run}/results.json", "plots": plots}  # fmt: skip

    class Module:
        params = {"args": ["--concurrency", "1,2"], "out": None, "no_recover": False}

        def run_command(self, argv):
            assert argv[-4:] == ["--ct", "200", "--concurrency", "1,2"]
            return 0, json.dumps({"run_dir": run, "files": files}), ""

    found = module.bench_one(Module(), "inventory.yml", 200)
    assert found["report_files"] == [files["markdown"], files["csv"], files["json"], *plots]


def test_a_skipped_check_task_is_a_skipped_check_of_each_ct_of_its_host():
    """Ansible drops a skipped task's result (no `res`): the report names the unmet needs."""
    from ops.ansible import _on_event

    run = PlaybookRun()
    planned = {"changed": True, "results": [_check_item(200, "ct-exists", "would change")]}
    for event in (
        _event("runner_on_ok", "a", "CT exists", "ddops_check", planned),
        {"event": "runner_on_skipped", "event_data": {
            "host": "a", "task": "CT config grants current majors", "task_action": "ddops_check"}},
        {"event": "runner_on_skipped", "event_data": {
            "host": "a", "task": "Engine installed in the CT", "task_action": "ddops_check"}},
    ):  # fmt: skip
        _on_event(run, event, "recover", True, None)
    (report,) = run.reports.values()
    assert [(r.key, r.status, r.evidence) for r in report.results] == [
        ("ct-exists", "would change", ""),
        ("ct-config", "skipped", "needs ct-exists"),
    ]  # engine-installed is not in recover's chain: its `when` skipped it
    assert run.hosts["a"].skipped_tasks == 2


def test_every_check_task_is_named_as_its_check():
    """The report maps a skipped task to its check by name (see the test above)."""
    tasks_dir = playbooks_dir() / "roles/ddops_chain/tasks"
    named = {
        task["name"].lower(): task["ddops_check"]["check"]
        for path in tasks_dir.glob("*.yml")
        for task in yaml.safe_load(path.read_text()) or []
        if "ddops_check" in task
    }
    chain = chain_for("provision")
    assert named == {c.title.lower(): c.key for c in chain if c.key != "boot"}  # boot: templates


def test_events_become_per_ct_reports_and_per_host_outcomes():
    from ops.ansible import _on_event

    run, lines = PlaybookRun(), []
    events = [
        _event(
            "runner_on_ok",
            "a",
            "CT exists",
            "ddops_check",
            {
                "changed": True,
                "results": [_check_item(200, "ct-exists", "changed")],
            },
        ),
        _event(
            "runner_on_ok",
            "b",
            "CT exists",
            "ddops_check",
            {
                "changed": False,
                "results": [_check_item(201, "ct-exists", "failed", "no CT")],
            },
        ),
        _event(
            "runner_on_failed",
            "b",
            "Every container passed its checks",
            "assert",
            {
                "msg": "CT 201: CT exists: no CT",
            },
        ),
        _event(
            "runner_on_unreachable",
            "c",
            "Host reachable",
            "ddops_check",
            {
                "msg": "ssh: connect to host c port 22: Connection refused",
            },
        ),
        {"event": "playbook_on_stats", "event_data": {}},
    ]
    for event in events:
        _on_event(run, event, "provision", False, lines.append)
    assert {h: (o.status, o.changed_tasks) for h, o in run.hosts.items()} == {
        "a": ("changed", 1),
        "b": ("failed", 0),
        "c": ("unreachable", 0),
    }
    assert run.hosts["b"].detail == "Every container passed its checks: CT 201: CT exists: no CT"
    assert [(r.host, r.vmid, r.ok) for r in run.reports.values()] == [
        ("a", 200, True),
        ("b", 201, False),
    ]
    assert not run.ok
    assert lines[0] == "a: CT 200:      changed  ct-exists (0.5s)"


# -- slow: real playbooks on two sim hosts -------------------------------------------------------


@dataclass
class Fleet:
    roots: dict[str, Path]  # host name -> its sim root
    inventory: Path

    def document(self) -> dict:
        return yaml.safe_load(self.inventory.read_text())

    def edit(self, host: str, **ct: object) -> None:
        document = self.document()
        document["all"]["hosts"][host]["ddops_containers"][0].update(ct)
        self.inventory.write_text(yaml.safe_dump(document))

    def file_state(self) -> dict[str, str]:
        """{path: sha256} of every file in the hosts' /etc, /var/lib/lxc and /var/lib/ddops, logs
        aside (a probe in a CT appends to its lxc.log)."""
        return {
            str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for root in self.roots.values()
            for base in ("etc", "var/lib/lxc", "var/lib/ddops")
            for p in sorted((root / base).rglob("*"))
            if p.is_file() and not p.is_symlink() and p.suffix != ".log"
        }

    def playbook(self, name: str, *, check: bool = False, wheel: Path | None = None) -> PlaybookRun:
        """The playbook over the host and CT steps (the engine steps load torch in the CT);
        with `wheel`, ddops itself is installed on each host first."""
        return run_playbook(
            name,
            with_local_connections(self.document()),
            check=check,
            tags=("host", "ct"),
            extravars={"ddops_wheel": str(wheel)} if wheel else {},
            mode=name,
        )

    def ddops(self, *args: str) -> tuple[int, dict | str]:
        return run_ddops(self.inventory, *args)


@contextlib.contextmanager
def two_sim_hosts(tmp_path: Path, hub_url: str, server) -> Iterator[Fleet]:
    """Sim hosts pve-local (local connection) and pve-ssh (SSH to loopback), one CT each."""
    roots = {name: tmp_path / f"{name}" for name in VMIDS}
    for root in roots.values():
        init_host(root, gpus=1, uvm_major=511, containers="lxc")
    known_hosts = server.write_known_hosts(tmp_path / "known_hosts")
    document = inventory_document(roots[LOCAL], hub_url, vmid=VMIDS[LOCAL])
    hosts = document["all"]["hosts"]
    hosts[LOCAL] = hosts.pop("pve")
    hosts[REMOTE] = {
        "ddops_target": f"{server.target}?sysroot={roots[REMOTE]}",
        "ansible_host": server.host,
        "ansible_port": server.port,
        "ansible_user": server.user,
        "ansible_ssh_private_key_file": str(server.client_key),
        "ansible_ssh_common_args": f"-o UserKnownHostsFile={known_hosts} -o StrictHostKeyChecking=yes",
        "ansible_python_interpreter": sys.executable,
        "ddops_containers": [{**hosts[LOCAL]["ddops_containers"][0], "vmid": VMIDS[REMOTE]}],
    }
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump(document))
    try:
        yield Fleet(roots, inventory)
    finally:
        for root in roots.values():
            destroy_host(root)


@pytest.fixture
def fleet(tmp_path, hub_root, sshd_server):
    with LocalHub(hub_root) as hub, two_sim_hosts(tmp_path, hub.url, sshd_server) as fleet:
        yield fleet


def statuses(run: PlaybookRun) -> dict[int, dict[str, str]]:
    return {vmid: {r.key: r.status for r in rep.results} for (_, vmid), rep in run.reports.items()}


@contextlib.contextmanager
def twin_host(root: Path) -> Iterator[Path]:
    init_host(root, gpus=1, uvm_major=511, containers="lxc")
    try:
        yield root
    finally:
        destroy_host(root)


def cli_path_through_the_ct_steps(fleet: Fleet, host: str, twin: Path) -> None:
    """What `ddops -i INVENTORY provision` does for `host` through the CT's own steps (config,
    start, hookscript), on a twin host: the chain's own probes and remedies, in order, with the
    fleet's inventory."""
    document = fleet.document()
    document["all"]["hosts"] = {
        host: document["all"]["hosts"][host] | {"ddops_target": f"sim:{twin}"}
    }
    twin_inventory = twin.parent / f"{twin.name}.yml"
    twin_inventory.write_text(yaml.safe_dump(document))
    with open_site(inventory=str(twin_inventory), host=None) as opened:
        (c,) = contexts(opened)
        c = replace(c, policy=Policy(mode="provision"))
        for check in chain_for("provision"):
            if not check.probe(c).ok:
                check.remedy(c, False)
            if check.key == "hookscript":
                return


@pytest.mark.slow
@pytest.mark.lxc
@pytest.mark.ssh
def test_check_then_apply_then_apply_again_and_the_files_equal_the_cli_paths(fleet, tmp_path):
    before = fleet.file_state()
    code, document = fleet.ddops("provision", "--via", "ansible", "--dry-run")
    assert fleet.file_state() == before
    assert code == 0, document
    assert {h["host"]: h["status"] for h in document["hosts"]} == {
        LOCAL: "changed",
        REMOTE: "changed",
    }
    skipped_tasks = {h["host"]: h["skipped_tasks"] for h in document["hosts"]}
    for ct in document["cts"]:
        checks = {c["key"]: c["status"] for c in ct["checks"]}
        assert checks["ct-exists"] == "would change", ct
        assert checks["ct-config"] == "skipped" and checks["model"] == "skipped"
        assert checks["modules"] == checks["nodes"] == "unchanged"
        moot = [key for key, status in checks.items() if status == "skipped"]
        assert skipped_tasks[ct["host"]] >= len(moot), (ct["host"], moot)  # Ansible: "skipping"

    with built_wheel() as wheel:
        applied = fleet.playbook("provision", wheel=wheel)
        for host, root in fleet.roots.items():  # ddops itself, on the local and the SSH host
            version = subprocess.run(
                [root / "opt/ddops/venv/bin/ddops", "--version"], capture_output=True, text=True
            )
            assert version.stdout.split()[-1] == ddops_version(), (host, version)
        again_with_wheel = fleet.playbook("provision", wheel=wheel)
    assert {h: o.status for h, o in applied.hosts.items()} == {
        LOCAL: "changed",
        REMOTE: "changed",
    }, applied.hosts
    assert {h: o.changed_tasks for h, o in again_with_wheel.hosts.items()} == {LOCAL: 0, REMOTE: 0}
    for vmid, checks in statuses(applied).items():
        assert checks["ct-exists"] == checks["ct-config"] == checks["ct-running"] == "changed", vmid
        assert checks["cuda"] == "unchanged", vmid
    after_apply = fleet.file_state()

    again = fleet.playbook("provision")
    assert {h: (o.status, o.changed_tasks) for h, o in again.hosts.items()} == {
        LOCAL: ("ok", 0),
        REMOTE: ("ok", 0),
    }
    assert all(s == "unchanged" for checks in statuses(again).values() for s in checks.values())
    assert fleet.file_state() == after_apply

    for host, vmid in VMIDS.items():
        with twin_host(tmp_path / f"cli-{host}") as twin:
            cli_path_through_the_ct_steps(fleet, host, twin)
            for path in [f"/etc/pve/lxc/{vmid}.conf", *BOOT_UNITS]:
                # a file may name a path on its host (the kernel hook's pin record): the sim
                # roots differ, what lies below them may not
                ours = _below_root(fleet.roots[host], path)
                assert ours == _below_root(twin, path), (host, path)


def _below_root(root: Path, path: str) -> bytes:
    """A file of a sim host with that host's root written as ROOT."""
    return (root / path.lstrip("/")).read_bytes().replace(str(root).encode(), b"ROOT")


@pytest.mark.slow
@pytest.mark.lxc
@pytest.mark.ssh
def test_a_host_that_fails_is_named_and_the_other_goes_on(fleet):
    fleet.edit(REMOTE, memory_mib=256)  # cannot hold the model: the capacity check refuses it
    code, document = fleet.ddops("provision", "--via", "ansible", "--dry-run")
    assert code == 1
    hosts = {h["host"]: h for h in document["hosts"]}
    assert hosts[REMOTE]["status"] == "failed"
    assert f"CT {VMIDS[REMOTE]}: CT memory holds model + engine: " in hosts[REMOTE]["detail"]
    assert "raise memory_mib" in hosts[REMOTE]["detail"]
    assert hosts[LOCAL]["status"] == "changed"
    by_ct = {ct["ct"]: {c["key"]: c["status"] for c in ct["checks"]} for ct in document["cts"]}
    assert by_ct[VMIDS[REMOTE]]["capacity"] == "failed"
    assert by_ct[VMIDS[REMOTE]]["modules"] == "skipped"  # after a failure the CT's chain stops
    assert by_ct[VMIDS[LOCAL]]["ct-exists"] == "would change"  # the other host went on


@pytest.mark.slow  # the engine steps import torch in the CT and load the model: minutes here
@pytest.mark.lxc
def test_the_whole_chain_via_ansible_then_recover_changes_nothing(tmp_path, hub_root, monkeypatch):
    """provision --via ansible from nothing to an engine that answers, with the operator's API
    key; recover --via ansible then finds nothing to do and keeps the key; bench --via ansible
    measures and fetches the report files; the engine unit equals the one the CLI path writes."""
    with sim_site(tmp_path / "ansible", hub_root) as site:
        monkeypatch.setenv("DDOPS_API_KEY", "sk-ansible-5e6f")
        code, document = site.ddops("provision", "--via", "ansible")
        assert code == 0, document
        assert "sk-ansible-5e6f" not in json.dumps(document)
        monkeypatch.delenv("DDOPS_API_KEY")
        (ct,) = document["cts"]
        keys = {check.key for check in chain_for("provision")}
        assert {c["key"] for c in ct["checks"]} == keys - {"boot"}  # boot: template tasks
        assert {c["status"] for c in ct["checks"]} <= {"changed", "unchanged"}
        assert {c["key"]: c["status"] for c in ct["checks"]}["engine"] in ("changed", "unchanged")

        code, again = site.ddops("recover", "--via", "ansible")
        assert code == 0, again
        assert {c["status"] for ct in again["cts"] for c in ct["checks"]} == {"unchanged"}
        assert site.ct_sh("cat /etc/ddops/engine.env") == "DDOPS_API_KEY=sk-ansible-5e6f\n"
        # The play installed ddops on the host, and the boot units run it: nobody acts here.
        wrapper = (site.root / "usr/local/bin/ddops").read_text()
        assert f"{site.root}/opt/ddops/venv/bin/python" in wrapper
        reboot_host(site.root, uvm_major=509)
        code, health = site.ddops("health", "--ct", str(site.vmid))
        assert code == 0, health
        assert health["cts"][0]["last_recover"]["trigger"] == "boot"
        code, benched = site.ddops(
            "bench",
            "--via",
            "ansible",
            "--methods",
            "ar,ddtree:4",
            "--lengths",
            "8",
            "--warmup",
            "0",
        )
        assert code == 0, benched
        (bench,) = benched["benches"]
        assert (bench["host"], bench["vmid"], bench["rc"]) == ("pve", site.vmid, 0)
        assert {row["method"] for row in bench["document"]["rows"]} == {"ar", "ddtree:4"}
        run_name = Path(bench["document"]["run_dir"]).name
        fetched = Path(benched["fetched_to"]) / "pve" / run_name
        assert sorted(p.name for p in fetched.iterdir()) == sorted(
            Path(path).name for path in bench["report_files"]
        )

        unit = site.ct_sh(f"cat {SUPERVISED_UNIT}")
        site.t.run(["pct", "stop", str(site.vmid)]).check("stop")  # frees the engine's port

        with sim_site(tmp_path / "cli", hub_root) as twin:
            twin.inventory.write_text(
                site.inventory.read_text().replace(str(site.root), str(twin.root))
            )
            code, direct = twin.ddops("provision")
            assert code == 0, direct
            assert twin.ct_sh(f"cat {SUPERVISED_UNIT}") == unit


@pytest.mark.slow
@pytest.mark.lxc
def test_host_without_inventory_gets_a_one_host_inventory(tmp_path):
    """--host sim:PATH: ddops writes the inventory (the demo site) and the playbook plans on it."""
    root = tmp_path / "pve"
    with twin_host(root):
        result = CliRunner().invoke(
            cli,
            ["--host", f"sim:{root}", "--json", "provision", "--ct", "300", "--via", "ansible"]
            + ["--dry-run"],
        )
        assert result.exit_code == 0, result.output
        document = json.loads(result.stdout)
        assert [(h["host"], h["status"]) for h in document["hosts"]] == [("sim", "changed")]
        (ct,) = document["cts"]
        checks = {c["key"]: c["status"] for c in ct["checks"]}
        assert (ct["ct"], checks["capacity"], checks["ct-exists"]) == (
            300,
            "unchanged",
            "would change",
        )
