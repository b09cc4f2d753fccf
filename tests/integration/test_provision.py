"""`ddops provision` on a sim host (real LXC) with a local hub serving a tiny model pair.

    python -m pytest -q tests/integration/test_provision.py            # dry run + named failures
    python -m pytest -q --slow tests/integration/test_provision.py     # + from nothing to a healthy engine,
                                                           #   and no space left in /dev/shm

From nothing: the CT is created, its config grants the current majors, the model in its
/dev/shm is byte-identical to the hub's, the engine answers; a second run changes no file and
downloads nothing; a dry run changes nothing. Each named failure stops the run at its check.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import pytest
import yaml
from click.testing import CliRunner

from ops.chain.report import CheckResult
from ops.chain.runner import contexts, run_chain
from ops.cli import cli
from ops.sim import faults
from ops.sim.host import reboot_host
from ops.site.selection import open_site
from tests.helpers.site import DRAFT_REPO, TARGET_REPO, check_of, sim_site, statuses

pytestmark = pytest.mark.lxc

HUB_TOKEN = "hf_test_0123456789abcdef"
CHAIN_KEYS = [
    "host",
    "capacity",
    "modules",
    "nodes",
    "gpu-majors",
    "gpu-capacity",
    "boot",
    "ct-exists",
    "ct-config",
    "ct-running",
    "hookscript",
    "cuda",
    "engine-installed",
    "model",
    "api-key",
    "service",
    "engine",
    "boot-kernel",
    "bench",
    "host-ddops",
    "cgroup-keys",
]


@pytest.fixture
def site(tmp_path, hub_root):
    with sim_site(tmp_path, hub_root) as site:
        yield site


def host_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file of the sim host; its logs, /run (a tmpfs: the recover lock) and the
    sim's own bookkeeping (what a real host keeps in its kernel) aside."""
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and not p.is_symlink()
        and "log" not in p.name
        and p.relative_to(root).parts[0] != "run"
        and "var/lib/ddops-sim" not in str(p)
    }


def edit_inventory(path: Path, edit) -> None:
    document = yaml.safe_load(path.read_text())
    edit(document["all"])
    path.write_text(yaml.safe_dump(document))


def test_dry_run_from_nothing_plans_and_changes_nothing(site):
    before = host_hashes(site.root)
    code, document = site.ddops("provision", "--ct", "200", "--dry-run")
    assert code == 0, document
    assert statuses(document) == {
        "host": "unchanged",
        "capacity": "unchanged",
        "modules": "unchanged",
        "nodes": "unchanged",
        "gpu-majors": "would change",
        "gpu-capacity": "unchanged",
        "boot": "would change",
        "ct-exists": "would change",
        "ct-config": "skipped",
        "ct-running": "skipped",
        "hookscript": "skipped",
        "cuda": "skipped",
        "engine-installed": "skipped",
        "model": "skipped",
        "api-key": "skipped",
        "service": "skipped",
        "engine": "skipped",
        "boot-kernel": "unchanged",
        "bench": "unchanged",
        "host-ddops": "would change",
        "cgroup-keys": "skipped",
    }
    boot = check_of(document, "boot")
    assert "+Before=pve-guests.service" in boot["diff"]
    assert "/usr/local/bin/ddops -i /etc/ddops/site.yml recover --ct 200 --at-boot" in boot["diff"]
    assert check_of(document, "ct-exists")["action"].startswith("would run `pct create 200 ")
    assert "--unprivileged 1 --features nesting=1`" in check_of(document, "ct-exists")["action"]
    site_diff = check_of(document, "host-ddops")["diff"]  # issue 32: the site file's diff too
    assert site_diff.startswith("--- /etc/ddops/site.yml\n+++ /etc/ddops/site.yml (planned)\n")
    assert any(x.startswith("+") and "ddops_target: sim:" in x for x in site_diff.splitlines())
    assert host_hashes(site.root) == before
    assert site.hub.bytes_served == 0


@pytest.fixture
def private_site(tmp_path, hub_root, monkeypatch):
    """The hub answers only with the token; HF_TOKEN in the environment carries it."""
    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    with sim_site(tmp_path, hub_root, hub_token=HUB_TOKEN) as site:
        yield site


@pytest.mark.slow
def test_from_nothing_to_healthy_then_a_second_run_changes_nothing(private_site):
    site = private_site
    code, document = site.ddops("provision", "--ct", "200")
    assert code == 0, document
    assert HUB_TOKEN not in json.dumps(document)
    assert list(statuses(document)) == CHAIN_KEYS
    assert set(statuses(document).values()) <= {"changed", "unchanged"}
    assert all(c["seconds"] >= 0 for c in document["cts"][0]["checks"])

    config = site.t.read_text("/etc/pve/lxc/200.conf")
    for index, node in enumerate(["nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]):
        assert f"dev{index}: /dev/{node},gid=44\n" in config  # PVE 8.2: majors granted at start
    assert "unprivileged: 1\n" in config and "features: nesting=1\n" in config
    assert "size=1g" in config
    assert site.shm_digests("target") == site.hub_digests(TARGET_REPO)
    assert site.shm_digests("draft") == site.hub_digests(DRAFT_REPO)
    key = check_of(document, "api-key")
    assert key["action"].startswith("generated an API key into /etc/ddops/engine.env (0600)")
    generated = installed_key(site)
    assert len(generated) >= 32 and generated not in json.dumps(document)
    assert completion(site).status_code == 401
    answer = completion(site, generated).json()
    assert answer["usage"]["completion_tokens"] >= 1 and answer["choices"][0]["text"], answer
    assert check_of(document, "engine")["evidence"].endswith("API key required")

    files, served = site.file_state(), site.hub.bytes_served
    code, again = site.ddops("provision", "--ct", "200")
    assert code == 0 and set(statuses(again).values()) == {"unchanged"}
    assert site.file_state() == files  # no file rewritten: mtimes and hashes
    assert site.hub.bytes_served == served  # zero bytes downloaded

    before = host_hashes(site.root)
    code, planned = site.ddops("provision", "--ct", "200", "--dry-run")
    assert code == 0 and set(statuses(planned).values()) == {"unchanged"}
    assert host_hashes(site.root) == before


def installed_key(site) -> str:
    (line,) = site.ct_sh("cat /etc/ddops/engine.env").splitlines()
    return line.removeprefix("DDOPS_API_KEY=")


def completion(site, key: str | None = None) -> httpx.Response:
    port = yaml.safe_load(site.inventory.read_text())["all"]["vars"]["ddops_engine"]["port"]
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0},  # sampling may draw eos
        headers={"Authorization": f"Bearer {key}"} if key else {},
        timeout=60,
    )


@pytest.mark.slow
def test_the_api_key_survives_reboot_and_recover_and_provision_rotates_it(site, monkeypatch):
    monkeypatch.setenv("DDOPS_API_KEY", "sk-first-1a2b")
    code, document = site.ddops("provision", "--ct", "200")
    assert code == 0, document
    assert (
        check_of(document, "api-key")["action"]
        == "wrote DDOPS_API_KEY to /etc/ddops/engine.env (0600)"
    )
    monkeypatch.delenv("DDOPS_API_KEY")
    reboot_host(site.root, uvm_major=509)  # the boot units recover with no key in their env
    code, document = site.ddops("recover", "--ct", "200")
    assert code == 0, document
    assert "api-key" not in statuses(document)  # recover keeps whatever key is installed
    assert completion(site).status_code == 401
    assert completion(site, "sk-first-1a2b").status_code == 200

    monkeypatch.setenv("DDOPS_API_KEY", "sk-second-3c4d")
    code, document = site.ddops("provision", "--ct", "200")
    assert code == 0, document
    changed = {k for k, v in statuses(document).items() if v == "changed"}
    assert changed == {"api-key"}  # rotated although every other check passed
    assert check_of(document, "api-key")["action"].endswith("; restarted the engine")
    assert completion(site, "sk-first-1a2b").status_code == 401
    assert completion(site, "sk-second-3c4d").status_code == 200

    monkeypatch.delenv("DDOPS_API_KEY")
    code, document = site.ddops("provision", "--ct", "200")
    assert code == 0 and set(statuses(document).values()) == {"unchanged"}, document
    assert installed_key(site) == "sk-second-3c4d"
    code, document = site.ddops("provision", "--ct", "200", "--no-api-key")
    assert code == 0, document
    assert completion(site).status_code == 200
    assert check_of(document, "engine")["evidence"].endswith("no API key: anyone who reaches it")


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        ("", (), "DDOPS_API_KEY must be 1-4096 characters"),
        ("two words", (), "(got 9 characters, some not allowed)"),
        ("sk-1", ("--no-api-key",), "--no-api-key and DDOPS_API_KEY contradict each other"),
        ("sk-1", ("--store-hf-token",), "--store-hf-token needs HF_TOKEN in the environment"),
    ],
    ids=["empty", "not-a-token", "contradiction", "token-to-store-missing"],
)
def test_a_bad_api_key_is_a_usage_error_before_anything_runs(
    site, monkeypatch, env, flags, message
):
    monkeypatch.setenv("DDOPS_API_KEY", env)
    before = host_hashes(site.root)
    result = CliRunner().invoke(
        cli, ["-i", str(site.inventory), "provision", "--ct", "200", *flags]
    )
    assert result.exit_code == 2 and message in result.stderr
    if env:
        assert env not in result.stderr  # a secret is never echoed
    assert host_hashes(site.root) == before


def test_unreachable_host_is_named_and_nothing_else_runs(site):
    edit_inventory(
        site.inventory,
        lambda group: group["hosts"]["pve"].update(ddops_target="ssh://root@127.0.0.1:1"),
    )
    code, document = site.ddops("provision", "--ct", "200")
    assert code == 1
    host = check_of(document, "host")
    assert host["status"] == "failed" and "unreachable" in host["evidence"]
    assert set(list(statuses(document).values())[1:]) == {"skipped"}
    human = CliRunner().invoke(cli, ["-i", str(site.inventory), "provision", "--ct", "200"])
    assert human.exit_code == 1
    assert human.stderr.splitlines()[-1] == (
        "Error: ssh://root@127.0.0.1:1: unreachable: connection refused on port 1"
    )
    assert "host reachable" in human.stdout and "skipped" in human.stdout


def test_a_private_hub_without_hf_token_is_refused(tmp_path, hub_root):
    with sim_site(tmp_path, hub_root, hub_token=HUB_TOKEN) as site:
        code, document = site.ddops("provision", "--ct", "200")
    assert code == 1
    assert check_of(document, "capacity")["evidence"] == (
        f"model {TARGET_REPO}: repository not found on the hub (or no access: check HF_TOKEN)"
    )


def test_locked_ct_stops_the_run_naming_the_lock(site):
    site.t.run(["pct", "create", "200", "local:vztmpl/debian-12.tar.zst"]).check("create")
    faults.lock_ct(site.root, 200, "backup")
    code, document = site.ddops("provision", "--ct", "200")
    assert code == 1
    running = check_of(document, "ct-running")
    assert running["status"] == "failed"
    assert running["evidence"].startswith("CT 200 is locked (backup): once the backup is over")
    assert statuses(document)["cuda"] == "skipped"


@pytest.mark.parametrize(
    ("edit", "evidence"),
    [
        (
            lambda group: group["hosts"]["pve"]["ddops_containers"][0].update(memory_mib=1024),
            "CT 200: memory 1024 MiB cannot hold the staged model (1 MiB in /dev/shm) plus the "
            "engine (~2048 MiB): raise memory_mib to at least 2049",
        ),
        (
            lambda group: group["vars"]["ddops_model"]["target"].update(repo="ddops/none"),
            "model ddops/none: repository not found on the hub (or no access: check HF_TOKEN)",
        ),
        (
            lambda group: group["vars"]["ddops_model"]["draft"].update(revision="v9"),
            f"model {DRAFT_REPO}: revision 'v9' not found on the hub",
        ),
    ],
    ids=["memory-too-small", "repo-not-found", "revision-not-found"],
)
def test_what_the_ct_cannot_serve_is_refused_before_anything_changes(site, edit, evidence):
    edit_inventory(site.inventory, edit)
    before = host_hashes(site.root)
    code, document = site.ddops("provision", "--ct", "200")
    assert code == 1
    capacity = check_of(document, "capacity")
    assert (capacity["status"], capacity["evidence"]) == ("failed", evidence)
    assert host_hashes(site.root) == before


@pytest.mark.slow  # the engine-installed check imports torch in the CT first
def test_no_space_left_in_dev_shm_is_named(site):
    def fill_shm_once_cuda_works(result: CheckResult) -> None:
        if result.key == "cuda":  # the CT runs with its final /dev/shm (1 GiB): fill it
            site.ct_sh("head -c 2G /dev/zero > /dev/shm/filler || true")

    with open_site(inventory=str(site.inventory), host=None, vmids=[200]) as opened:
        (c,) = contexts(opened)
        report = run_chain(c, mode="provision", on_result=fill_shm_once_cuda_works)
    model = next(r for r in report.results if r.key == "model")
    assert model.status == "failed"
    assert "no space left in /dev/shm/models: the model needs" in model.action
    assert [r.status for r in report.results[-3:]] == ["skipped"] * 3
