"""Bad inventories through the real CLI: each one exits 2 with one `Error: <object>: <cause>` line,
no traceback, and nothing on the (simulated) host changes.

The table is what a careless or hostile operator might write: broken files, wrong types,
out-of-range values, multi-line values that would smuggle a line into a CT config, shell words.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ops.cli import cli
from ops.sim.host import init_host
from ops.site.inventory import load_site

GOOD = """\
all:
  vars:
    ddops_model:
      target: {repo: ddops/demo-target, revision: main}
      draft: {repo: ddops/demo-draft}
      hub_endpoint: http://127.0.0.1:9
    ddops_engine: {method: ddtree, budget: 15, port: 8000, max_model_len: 2048, dtype: float32,
                   device: cpu, python: /usr/bin/python3}
  hosts:
    pve1:
      ddops_target: sim:SIMROOT
      ddops_containers:
        - {vmid: 200, hostname: llm, cores: 2, memory_mib: 4096, swap_mib: 0, gpus: [0],
           shm_gib: 2, onboot: true, ostemplate: "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst",
           rootfs: "local-lvm:8", net0: "name=eth0,bridge=vmbr0,ip=dhcp", device_style: auto}
"""

# (id, old text in GOOD, new text): one substitution each
SUBSTITUTIONS = [
    ("memory-1e30-string", "memory_mib: 4096", "memory_mib: 1e30"),
    ("memory-1e30-float", "memory_mib: 4096", "memory_mib: 1.0e+30"),
    ("memory-huge-int", "memory_mib: 4096", "memory_mib: 100000000000"),
    ("memory-too-small", "memory_mib: 4096", "memory_mib: 64"),
    ("memory-string", "memory_mib: 4096", "memory_mib: '4096'"),
    ("swap-negative", "swap_mib: 0", "swap_mib: -4096"),
    ("swap-float", "swap_mib: 0", "swap_mib: 0.5"),
    ("cores-zero", "cores: 2", "cores: 0"),
    ("cores-bool", "cores: 2", "cores: true"),
    ("shm-zero", "shm_gib: 2", "shm_gib: 0"),
    ("gpus-int", "gpus: [0]", "gpus: 0"),
    ("gpus-twice", "gpus: [0]", "gpus: [0, 0]"),
    ("gpus-negative", "gpus: [0]", "gpus: [-1]"),
    ("gpus-string", "gpus: [0]", "gpus: ['0']"),
    ("onboot-yes-string", "onboot: true", 'onboot: "yes"'),
    ("onboot-int", "onboot: true", "onboot: 1"),
    ("vmid-bool", "vmid: 200", "vmid: true"),
    ("vmid-float", "vmid: 200", "vmid: 200.0"),
    ("vmid-low", "vmid: 200", "vmid: 99"),
    ("vmid-shell", "vmid: 200", "vmid: '200; reboot'"),
    ("hostname-newline", "hostname: llm", 'hostname: "llm\\n"'),
    ("hostname-space", "hostname: llm", "hostname: 'bad host'"),
    ("net0-newline", '"name=eth0,bridge=vmbr0,ip=dhcp"', '"name=eth0,bridge=vmbr0,ip=dhcp\\n"'),
    (
        "net0-smuggled-line",
        '"name=eth0,bridge=vmbr0,ip=dhcp"',
        '"name=eth0,ip=dhcp\\nlxc.apparmor.profile: unconfined"',
    ),
    ("net0-shell", '"name=eth0,bridge=vmbr0,ip=dhcp"', '"name=eth0;reboot"'),
    ("net0-unknown-key", '"name=eth0,bridge=vmbr0,ip=dhcp"', '"name=eth0,evil=1"'),
    ("ostemplate-newline", '_amd64.tar.zst"', '_amd64.tar.zst\\n"'),
    (
        "ostemplate-path",
        '"local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"',
        '"/etc/passwd"',
    ),
    ("rootfs-newline", '"local-lvm:8"', '"local-lvm:8\\n"'),
    ("rootfs-int", '"local-lvm:8"', "8"),
    ("rootfs-no-size", '"local-lvm:8"', '"local-lvm"'),
    ("device-style", "device_style: auto", "device_style: DevN"),
    ("container-unknown-key", "cores: 2", "corez: 2"),
    # issue 32: a model without its repo was a traceback (ModelRef.__init__() missing 'repo')
    (
        "model-without-repo",
        "target: {repo: ddops/demo-target, revision: main}",
        "target: {revision: main}",
    ),
    ("draft-without-repo", "draft: {repo: ddops/demo-draft}", "draft: {name: draft}"),
    ("privileged-string", "device_style: auto", "device_style: auto, privileged: 'yes'"),
    ("gpu-gid-zero", "device_style: auto", "device_style: auto, gpu_gid: 0"),
    ("port-bool", "port: 8000", "port: true"),
    ("port-float", "port: 8000", "port: 8000.5"),
    ("port-zero", "port: 8000", "port: 0"),
    ("port-high", "port: 8000", "port: 70000"),
    ("port-string", "port: 8000", "port: '8000'"),
    ("budget-zero", "budget: 15", "budget: 0"),
    ("max-model-len-tiny", "max_model_len: 2048", "max_model_len: 8"),
    ("method-unknown", "method: ddtree", "method: beam"),
    ("dtype-unknown", "dtype: float32", "dtype: float16"),
    ("device-unknown", "device: cpu", "device: tpu"),
    ("device-newline", "device: cpu", 'device: "cuda\\n"'),
    ("python-relative", "python: /usr/bin/python3", "python: python3"),
    ("python-multi-word", "python: /usr/bin/python3", "python: '/usr/bin/python3 -c x'"),
    ("python-dotdot", "python: /usr/bin/python3", "python: /opt/../usr/bin/python3"),
    ("python-newline", "python: /usr/bin/python3", 'python: "/usr/bin/python3\\n"'),
    ("engine-int", "ddops_engine: {method", "ddops_engine: 5\n    old_engine: {method"),
    ("hub-ftp", "hub_endpoint: http://127.0.0.1:9", "hub_endpoint: ftp://127.0.0.1:9"),
    ("hub-userinfo", "hub_endpoint: http://127.0.0.1:9", "hub_endpoint: https://u:pw@hub.example"),
    ("hub-newline", "hub_endpoint: http://127.0.0.1:9", 'hub_endpoint: "https://hub.example\\n"'),
    ("hub-not-url", "hub_endpoint: http://127.0.0.1:9", "hub_endpoint: huggingface.co"),
    ("hub-int", "hub_endpoint: http://127.0.0.1:9", "hub_endpoint: 9"),
    ("model-unknown-key", "hub_endpoint: http", "hub_endpiont: x\n      hub_endpoint: http"),
    ("repo-traversal", "repo: ddops/demo-target", "repo: ../../etc/passwd"),
    ("repo-newline", "repo: ddops/demo-target", 'repo: "ddops/demo-target\\n"'),
    ("revision-newline", "revision: main", 'revision: "main\\n"'),
    ("revision-shell", "revision: main", "revision: '$(id)'"),
    ("draft-list", "draft: {repo: ddops/demo-draft}", "draft: [ddops/demo-draft]"),
    ("target-missing", "target: {repo: ddops/demo-target, revision: main}", "x: 1"),
    ("ddops-target-int", "ddops_target: sim:SIMROOT", "ddops_target: 42"),
    ("ddops-target-unknown", "ddops_target: sim:SIMROOT", "ddops_target: nowhere"),
    ("ddops-target-password", "ddops_target: sim:SIMROOT", "ddops_target: ssh://root:pw@pve1"),
    ("ansible-port-string", "ddops_target: sim:SIMROOT", "ansible_port: '22'"),
    ("ansible-port-zero", "ddops_target: sim:SIMROOT", "ansible_port: 0"),
    ("ansible-host-option", "ddops_target: sim:SIMROOT", "ansible_host: -oProxyCommand=x"),
    ("ansible-user-newline", "ddops_target: sim:SIMROOT", 'ansible_user: "root\\n"'),
    ("containers-mapping", "ddops_containers:\n", "ddops_containers:\n        x:\n"),
    ("host-vars-list", "pve1:\n", "pve1:\n      - 1\n    pve2:\n"),
    ("tp-without-gpus", "python: /usr/bin/python3}", "python: /usr/bin/python3, tp: 2}"),
    ("tp-three", "python: /usr/bin/python3}", "python: /usr/bin/python3, tp: 3}"),
]
# (id, the whole file)
WHOLE_FILES = [
    ("empty", b""),
    ("broken-yaml", b"all: [unclosed\n"),
    ("not-utf8", b"all:\n  vars: {x: '\xff\xfe'}\n"),
    ("top-level-list", b"- all\n"),
    ("all-a-list", b"all: [1, 2]\n"),
    ("python-tag", b"all: !!python/object/apply:os.system ['touch /tmp/ddops-pwned']\n"),
    ("int-host-name", b"all:\n  vars: {ddops_model: {target: {repo: a/b}}}\n  hosts: {1: {}}\n"),
    ("no-hosts", b"all:\n  vars: {ddops_model: {target: {repo: a/b}}}\n"),
]


@pytest.fixture(scope="module")
def sim_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("badinv") / "pve"
    init_host(root, gpus=1, containers="process")
    return root


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def _case_files() -> list:
    cases = []
    for case, old, new in SUBSTITUTIONS:
        cases.append(pytest.param(("sub", old, new), id=case))
    cases += [pytest.param(("file", data), id=case) for case, data in WHOLE_FILES]
    return cases


def _write_case(case: tuple, path: Path, sim_root: Path) -> None:
    if case[0] == "file":
        path.write_bytes(case[1])
        return
    _, old, new = case
    assert old in GOOD, old
    path.write_text(GOOD.replace(old, new, 1).replace("SIMROOT", str(sim_root)))


def test_the_good_inventory_is_accepted(sim_root, tmp_path):
    """The table's base is valid: each case is bad for its one change only."""
    inventory = tmp_path / "site.yml"
    inventory.write_text(GOOD.replace("SIMROOT", str(sim_root)))
    site = load_site(inventory)
    assert site.find_container(200)[1].memory_mib == 4096
    assert site.engine.python == "/usr/bin/python3"


@pytest.mark.parametrize("case", _case_files())
def test_bad_inventory_exits_2_with_one_line(case, sim_root, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    inventory = tmp_path / "site.yml"
    _write_case(case, inventory, sim_root)
    before = _tree(sim_root)
    result = CliRunner().invoke(cli, ["-i", str(inventory), "provision", "--ct", "200"])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit)  # nothing escaped as a traceback
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert ": " in lines[0].removeprefix("Error: ")  # <object>: <cause>
    assert "pw@" not in lines[0]  # a password in a URL is never echoed
    assert _tree(sim_root) == before
    assert not os.path.exists("/tmp/ddops-pwned")


def test_plain_http_hub_with_a_token_is_refused(sim_root, tmp_path, monkeypatch):
    """A token would go in clear to a hub that is not on this machine: https is required."""
    inventory = tmp_path / "site.yml"
    remote = GOOD.replace("http://127.0.0.1:9", "http://hub.example.org")
    inventory.write_text(remote.replace("SIMROOT", str(sim_root)))
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    result = CliRunner().invoke(cli, ["-i", str(inventory), "health", "--ct", "200"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"Error: {inventory}: ddops_model.hub_endpoint: 'http://hub.example.org': HF_TOKEN "
        "would cross the network unencrypted; use https"
    ]
    assert "hf_secret_value" not in result.output


def test_a_real_process_gets_one_line_for_a_non_utf8_file(tmp_path):
    inventory = tmp_path / "site.yml"
    inventory.write_bytes(GOOD.encode().replace(b"llm", b"ll\xe9m"))
    bad_byte = GOOD.encode().index(b"llm") + 2
    proc = subprocess.run(
        [sys.executable, "-m", "ops.cli", "-i", str(inventory), "health", "--ct", "200"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"Error: {inventory}: not UTF-8 text (byte {bad_byte})"]


@pytest.mark.parametrize("with_inventory", [True, False])
def test_a_password_in_host_is_never_echoed(sim_root, tmp_path, with_inventory):
    inventory = tmp_path / "site.yml"
    inventory.write_text(GOOD.replace("SIMROOT", str(sim_root)))
    args = ["-i", str(inventory)] if with_inventory else []
    args += ["--host", "ssh://root:hunter2@pve1", "health", "--ct", "200"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2
    assert len(result.stderr.splitlines()) == 1
    assert "hunter2" not in result.output and "***" in result.stderr
