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
---
module: ddops_bench
short_description: Run C(ddops bench) for each GPU container of a Proxmox VE host, on that host
version_added: "0.1.0"
description:
  - Benches the engine of each selected GPU container (CT) of the managed host, on the host itself, so that a play over
    the fleet benches every host's CTs in parallel (as C(playbooks/bench.yml) and C(ddops bench --via ansible) do).
  - The module writes a one-host inventory in which the host is C(local) (C(sim:PATH) for a simulated host) and runs
    C(python -m ops.cli -i INVENTORY --json bench --ct VMID ...) once per CT, with the interpreter that runs the module.
  - "The bench's own preflight runs there too, for each CT: the health chain, then recover when a check fails (unless
    O(no_recover=true)). A CT that is not healthy afterwards fails its bench."
  - Each bench writes a new run under the results directory on the host (O(out)). The module returns each run's JSON
    document and the paths of its report files, which a later M(ansible.builtin.fetch) task can bring back.
  - Every selected CT is benched; the task fails afterwards when any bench failed, with RV(benches) holding every
    CT's outcome.
options:
  containers:
    description:
      - The host's containers, its C(ddops_containers) inventory variable.
      - Each is a mapping with a C(vmid) and the CT's other settings (C(hostname), C(cores), C(memory_mib), C(gpus),
        ...), validated as the ddops CLI validates its inventory.
    type: list
    elements: dict
    required: true
  model:
    description:
      - The model the engines serve, the C(ddops_model) inventory variable.
      - A mapping with C(target) (C(repo), C(revision)), an optional C(draft) and an optional C(hub_endpoint).
    type: dict
    required: true
  engine:
    description:
      - The engine settings, the C(ddops_engine) inventory variable (C(method), C(budget), C(port),
        C(max_model_len), C(max_num_seqs), C(kv_cache_tokens), C(tp), C(dtype), C(device), C(python)); an empty mapping takes ddops' defaults.
    type: dict
    default: {}
  sysroot:
    description:
      - The root directory of a simulated host (the C(ddops_sysroot) inventory variable).
      - When unset, the one of O(target) is used; a real host has none.
    type: str
  target:
    description:
      - The host's C(ddops_target) inventory variable (C(local), C(sim:PATH), C(ssh://[user@]host[:port][?sysroot=PATH])).
      - Only its simulated root (C(sim:PATH), C(?sysroot=PATH)) is used, when O(sysroot) is unset; the bench itself
        always runs on the managed host.
    type: str
  vmids:
    description:
      - Bench only these containers of O(containers); an empty list benches them all.
      - A vmid that is not in O(containers) selects nothing.
    type: list
    elements: int
    default: []
  args:
    description:
      - Options passed to C(ddops bench) after C(--ct VMID), one list item per word.
      - For example V(["--methods", "ar,ddtree:15", "--lengths", "256,1024"]).
    type: list
    elements: str
    default: []
  out:
    description:
      - The results directory on the host, passed as C(--out).
      - When unset, ddops' own (C($DDOPS_RESULTS), else C(<ddops home>/results)).
    type: str
  no_recover:
    description:
      - Pass C(--no-recover); a CT whose health check fails then fails its bench instead of being recovered first.
    type: bool
    default: false
  host_name:
    description:
      - The host's name in the one-host inventory, normally its C(inventory_hostname), as in the host's own site file.
    type: str
    default: this
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details:
      - In check mode nothing runs on the host, neither the preflight nor the bench. A bench always writes a new run,
        so the task reports C(changed) when any CT is selected, with RV(msg) naming them and an empty RV(benches).
  diff_mode:
    support: none
  platform:
    platforms: posix
    details:
      - A Proxmox VE host, or a simulated one (a directory, on any POSIX machine).
notes:
  - The module runs on the managed host under an interpreter that has ddops installed (C(ansible_python_interpreter)).
  - It needs the C(ddops_host) module utility of the C(ddops_chain) role (its C(module_utils/), beside its C(library/)).
  - The task reports C(changed) whenever a bench ran, since each run is new.
seealso:
  - module: ansible.legacy.ddops_check
    description: The health and recover chain, one check per task.
  - module: ansible.builtin.fetch
    description: Bring the report files of RV(benches[].report_files) back to the controller.
author:
  - ddops maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Bench each CT on its host with ddops' default methods and lengths
  ddops_bench:
    containers: "{{ ddops_containers }}"
    model: "{{ ddops_model }}"
    engine: "{{ ddops_engine | default({}) }}"
    host_name: "{{ inventory_hostname }}"
  register: ddops_bench

- name: Bench CT 200 only, two methods at two lengths, without recovering first
  ddops_bench:
    containers: "{{ ddops_containers }}"
    model: "{{ ddops_model }}"
    vmids: [200]
    args: [--methods, "ar,ddtree:15", --lengths, "256,1024"]
    no_recover: true
    host_name: "{{ inventory_hostname }}"

- name: Bench the CTs of a simulated host, keeping the runs in /srv/ddops-results
  ddops_bench:
    containers: "{{ ddops_containers }}"
    model: "{{ ddops_model }}"
    target: "sim:/tmp/pve1"
    out: /srv/ddops-results
    host_name: "{{ inventory_hostname }}"
"""

RETURN = r"""
benches:
  description:
    - One entry per selected CT, in the order of O(containers).
    - Empty in check mode, where nothing runs.
  returned: always
  type: list
  elements: dict
  contains:
    vmid:
      description: The CT's vmid.
      returned: always
      type: int
      sample: 200
    rc:
      description: The exit status of C(ddops bench); V(0) when the bench succeeded.
      returned: always
      type: int
      sample: 0
    document:
      description:
        - The JSON document C(ddops --json bench) printed.
      returned: when the bench printed its JSON document
      type: dict
      contains:
        target:
          description: What was benched, in words.
          returned: always
          type: str
          sample: CT 200 on local
        run_dir:
          description: The run's directory on the host, under the results directory.
          returned: always
          type: str
          sample: /root/.config/ddops/results/20261201T101500Z-3f2a9c
        state:
          description: The run's state (C(running), C(complete) or C(crashed)).
          returned: always
          type: str
          sample: complete
        resumed:
          description: Whether the bench resumed a crashed run of the same configuration.
          returned: always
          type: bool
          sample: false
        preflight:
          description: The preflight's chain reports, as JSON; health first, then recover when health failed.
          returned: always
          type: list
          elements: dict
        files:
          description: The run's report files on the host (C(markdown), C(csv), C(json) paths and a list of C(plots)).
          returned: always
          type: dict
          sample:
            markdown: /root/.config/ddops/results/20261201T101500Z-3f2a9c/report.md
            csv: /root/.config/ddops/results/20261201T101500Z-3f2a9c/results.csv
            json: /root/.config/ddops/results/20261201T101500Z-3f2a9c/results.json
            plots: []
        rows:
          description: One row per cell of the bench matrix (method, scenario, length), with its figures and its speedup over C(ar).
          returned: always
          type: list
          elements: dict
          sample:
            - {method: ddtree:15, scenario: decode, length: 256, decode_tok_s: 81.2, speedup: 2.9, skipped: null}
    error:
      description: The first line of the bench's error output (else of its output, else C(no output)).
      returned: when the bench printed no JSON document
      type: str
      sample: "Error: CT 200: not healthy: engine service not running (recover could not fix it)"
    report_files:
      description:
        - The run's markdown, CSV and JSON reports on the host, in that order, then its PNG plots, for M(ansible.builtin.fetch).
        - Empty when the bench printed no JSON document.
      returned: always
      type: list
      elements: str
      sample:
        - /root/.config/ddops/results/20261201T101500Z-3f2a9c/report.md
        - /root/.config/ddops/results/20261201T101500Z-3f2a9c/results.csv
        - /root/.config/ddops/results/20261201T101500Z-3f2a9c/results.json
        - /root/.config/ddops/results/20261201T101500Z-3f2a9c/plots/speedup_by_method_length.png
msg:
  description: What the module would do.
  returned: in check mode
  type: str
  sample: would bench CT(s) [200, 201]
"""

ARGUMENT_SPEC = {
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
}


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
    report_files += files.get("plots") or []
    return {"vmid": vmid, "rc": rc, "document": document, "report_files": report_files}


def main() -> None:
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
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
