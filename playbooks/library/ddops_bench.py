#!/usr/bin/python
"""Ansible module: `ddops bench` for each container of a host, run on the host itself.

Each host benches its own CTs: the module writes a one-host inventory in which the host is
`local` (or `sim:PATH` for a simulated host), runs `python -m ops.cli -i it --json bench --ct N
ARGS` with the interpreter that runs the module (it has ddops), and returns each run's JSON
document (run_dir, state, rows, report files). The bench's own preflight (health, recover when
a check fails, unless --no-recover) runs there too. In check mode nothing runs: a bench always
writes a new run, so it reports that it would.
"""

from __future__ import annotations

import json
import sys
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.ddops_host import host_sysroot

DOCUMENTATION = r"""
module: ddops_bench
short_description: Run `ddops bench` for each container of a Proxmox host, on that host
options:
  containers: {description: the host's ddops_containers, required: true, type: list, elements: dict}
  model: {description: ddops_model, required: true, type: dict}
  engine: {description: ddops_engine, default: {}, type: dict}
  sysroot: {description: root of a simulated host (ddops_sysroot), type: str}
  target: {description: the host's ddops_target, type: str}
  vmids: {description: only these containers (default all), default: [], type: list, elements: int}
  args: {description: "ddops bench options, e.g. [--methods, 'ar,ddtree:15', --lengths, '256']", default: [], type: list, elements: str}
  out: {description: results directory on the host (default ddops' own), type: str}
  no_recover: {description: fail instead of recovering when a health check fails, default: false, type: bool}
  host_name: {description: "the host's inventory name (inventory_hostname), as in its own site file", default: this, type: str}
"""

RETURN = r"""
benches: {description: "one entry per CT: vmid, rc, the bench's JSON document (or its error) and report_files", type: list}
"""


def local_inventory(params: dict, sysroot: str | None) -> dict:
    """This host as ddops on the host sees it: itself, simulated or not."""
    host = {
        "ddops_target": f"sim:{sysroot}" if sysroot else "local",
        "ddops_containers": params["containers"],
    }
    group_vars = {"ddops_model": params["model"], "ddops_engine": params["engine"]}
    return {"all": {"vars": group_vars, "hosts": {params["host_name"]: host}}}


def bench_argv(inventory: str, vmid: int, params: dict) -> list[str]:
    argv = [sys.executable, "-m", "ops.cli", "-i", inventory, "--json", "bench", "--ct", str(vmid)]
    argv += params["args"]
    if params["out"]:
        argv += ["--out", params["out"]]
    if params["no_recover"]:
        argv.append("--no-recover")
    return argv


def bench_one(module: AnsibleModule, inventory: str, vmid: int) -> dict:
    rc, stdout, stderr = module.run_command(bench_argv(inventory, vmid, module.params))
    try:
        document = json.loads(stdout)
    except ValueError:
        lines = (stderr.strip() or stdout.strip() or "no output").splitlines()
        return {"vmid": vmid, "rc": rc or 1, "error": lines[0], "report_files": []}
    files = document.get("files") or {}
    report_files = [files[kind] for kind in ("markdown", "csv", "json") if kind in files]
    return {"vmid": vmid, "rc": rc, "document": document, "report_files": report_files}


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "containers": {"type": "list", "elements": "dict", "required": True},
            "model": {"type": "dict", "required": True},
            "engine": {"type": "dict", "default": {}},
            "sysroot": {"type": "str"},
            "target": {"type": "str"},
            "vmids": {"type": "list", "elements": "int", "default": []},
            "args": {"type": "list", "elements": "str", "default": []},
            "out": {"type": "str"},
            "no_recover": {"type": "bool", "default": False},
            "host_name": {"type": "str", "default": "this"},
        },
        supports_check_mode=True,
    )
    params = module.params
    vmids = [int(ct["vmid"]) for ct in params["containers"]]
    vmids = [v for v in vmids if not params["vmids"] or v in params["vmids"]]
    if module.check_mode:
        module.exit_json(changed=bool(vmids), msg=f"would bench CT(s) {vmids}", benches=[])
    sysroot = host_sysroot(params["sysroot"], params["target"])
    with tempfile.NamedTemporaryFile("w", suffix=".yml", prefix="ddops-bench-") as inventory:
        json.dump(local_inventory(params, sysroot), inventory)  # JSON is YAML
        inventory.flush()
        benches = [bench_one(module, inventory.name, vmid) for vmid in vmids]
    failed = [b for b in benches if b["rc"] != 0]
    if failed:
        why = "; ".join(f"CT {b['vmid']}: {b.get('error') or 'bench failed'}" for b in failed)
        module.fail_json(msg=why, benches=benches)
    module.exit_json(changed=bool(benches), benches=benches)


if __name__ == "__main__":
    main()
