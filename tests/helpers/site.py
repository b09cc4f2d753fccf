"""A whole simulated site for tests: a sim Proxmox host, a local hub with a tiny model pair, and
the YAML inventory that ties them together.

    hub_root = make_tiny_hub_root(tmp_path_factory.mktemp("hub"))     # once per module (torch)
    with sim_site(tmp_path, hub_root) as site:                        # sim host + hub + inventory
        CliRunner().invoke(cli, ["-i", str(site.inventory), "provision", "--ct", "200"])
        site.hub.bytes_served                                         # file bytes sent so far

The CT itself is not created: `ddops provision` does that (`pct create`). The engine runs with
this Python (`sys.executable`), float32 on the CPU, so nothing is installed in the CT.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from ops.host.transport import LocalTransport
from ops.sim.host import destroy_host, init_host
from ops.sim.hub import LocalHub
from tests.helpers.simhost import PVE8

TARGET_REPO = "ddops/tiny-target"
DRAFT_REPO = "ddops/tiny-draft"
VMID = 200


def make_tiny_hub_root(root: Path) -> Path:
    """A hub directory holding a tiny random Qwen3 target and its DFlash drafter."""
    from tests.helpers.tiny_qwen3 import save_tiny_dflash, save_tiny_qwen3

    target = save_tiny_qwen3(root / TARGET_REPO, seed=0)
    save_tiny_dflash(root / DRAFT_REPO, target, seed=1)
    return root


@dataclass
class SimSite:
    root: Path  # the sim host's root
    t: LocalTransport
    hub: LocalHub
    inventory: Path
    vmid: int = VMID

    def hub_digests(self, repo: str) -> dict[str, str]:
        """{path: sha256} of a repo's files as the hub serves them."""
        base = self.hub.root / repo
        return {
            p.relative_to(base).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(base.rglob("*"))
            if p.is_file() and not p.name.startswith(".")
        }

    def shm_digests(self, name: str) -> dict[str, str]:
        """{path: sha256} of the files staged in the CT's /dev/shm/models/<name>."""
        base = f"/dev/shm/models/{name}"
        script = 'cd "$1" && find . -type f ! -name ".*" -exec sha256sum {} +'
        r = self.t.run(["pct", "exec", str(self.vmid), "--", "sh", "-c", script, "sh", base])
        r.check(f"CT {self.vmid}")
        return {
            path.removeprefix("./"): digest
            for digest, path in (line.split(maxsplit=1) for line in r.stdout.splitlines())
        }

    def ct_sh(self, script: str) -> str:
        """Run a shell snippet inside the CT; its stdout (raises on failure)."""
        r = self.t.run(["pct", "exec", str(self.vmid), "--", "sh", "-c", script])
        return r.check(f"CT {self.vmid}: {script}").stdout

    def ddops(self, *args: str) -> tuple[int, dict | str]:
        return run_ddops(self.inventory, *args)

    def file_state(self) -> dict[str, tuple[int, str]]:
        """{path: (mtime_ns, sha256)} of the host's /etc and the CT's /etc and /dev/shm/models."""
        state = {}
        for base in (self.root / "etc", self.root / f"var/lib/lxc/{self.vmid}/rootfs/etc"):
            for p in sorted(base.rglob("*")):
                if p.is_file():
                    state[str(p)] = (
                        p.stat().st_mtime_ns,
                        hashlib.sha256(p.read_bytes()).hexdigest(),
                    )
        listing = self.ct_sh(
            "find /dev/shm/models -type f -exec stat -c '%n %.9Y' {} + -exec sha256sum {} +"
        )
        state["ct:/dev/shm/models"] = (0, listing)
        return state

    def engine_pids(self) -> tuple[int, int]:
        """(the supervisor's pid, the engine's pid) as the CT sees them."""
        status = json.loads(self.ct_sh("cat /run/ddops/engine.status"))
        return int(self.ct_sh("cat /run/ddops/engine.pid")), int(status["engine_pid"])


def disable_boot_units(root: Path, *units: str) -> None:
    """Undo `systemctl enable` for these units (as on a host set up without them)."""
    for unit in units:
        (root / "etc/systemd/system/multi-user.target.wants" / unit).unlink()


def free_port() -> int:
    """A loopback port free now (the engine in the CT shares the host's network namespace)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inventory_document(
    sim_root: Path, hub_url: str, *, vmid: int = VMID, **container: object
) -> dict:
    """The site's inventory: one sim host, one CT, the tiny pair, the engine on this Python."""
    ct = {"vmid": vmid, "hostname": "llm", "memory_mib": 8192, "shm_gib": 1, **container}
    return {
        "all": {
            "vars": {
                "ddops_model": {
                    "target": {"repo": TARGET_REPO, "revision": "main", "name": "target"},
                    "draft": {"repo": DRAFT_REPO, "revision": "main", "name": "draft"},
                    "hub_endpoint": hub_url,
                },
                "ddops_engine": {
                    "method": "ddtree",
                    "budget": 4,
                    "port": free_port(),
                    "max_model_len": 256,
                    "dtype": "float32",
                    "device": "cpu",
                    "python": sys.executable,
                },
            },
            "hosts": {"pve": {"ddops_target": f"sim:{sim_root}", "ddops_containers": [ct]}},
        }
    }


@contextlib.contextmanager
def sim_site(
    tmp_path: Path,
    hub_root: Path,
    *,
    uvm_major: int = 511,
    pve_version: str = PVE8,
    hub_token: str | None = None,
    gpu_memory_mib: int = 97887,
    **ct,
) -> Iterator[SimSite]:
    """A fresh sim host (real LXC) + a running hub over `hub_root` (private with `hub_token`:
    it answers only `Authorization: Bearer <hub_token>`) + an inventory file."""
    root = tmp_path / "pve"
    init_host(
        root,
        gpus=1,
        uvm_major=uvm_major,
        pve_version=pve_version,
        containers="lxc",
        gpu_memory_mib=gpu_memory_mib,
    )
    with LocalHub(hub_root, token=hub_token) as hub:
        inventory = tmp_path / "inventory.yml"
        inventory.write_text(yaml.safe_dump(inventory_document(root, hub.url, **ct)))
        try:
            yield SimSite(root, LocalTransport(sysroot=str(root)), hub, inventory)
        finally:
            destroy_host(root)


def run_ddops(inventory: Path, *args: str) -> tuple[int, dict | str]:
    """`ddops -i INVENTORY --json ARGS` in this process: (exit code, its JSON document, or its
    output when it printed none); an exception other than the CLI's exit is raised."""
    from click.testing import CliRunner

    from ops.cli import cli

    result = CliRunner().invoke(cli, ["-i", str(inventory), "--json", *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    try:
        return result.exit_code, json.loads(result.stdout)
    except ValueError:
        return result.exit_code, result.output


def statuses(document: dict) -> dict[str, str]:
    """{check key: status} of a one-CT chain document."""
    (ct,) = document["cts"]
    return {check["key"]: check["status"] for check in ct["checks"]}


def check_of(document: dict, key: str) -> dict:
    """The check `key` of a one-CT chain document."""
    return next(c for c in document["cts"][0]["checks"] if c["key"] == key)
