#!/usr/bin/python
"""Ansible module: run one check of ddops' chain (ops/chain/checks.py) for each container of a host.

The playbooks call it once per step (`ddops_check: {check: ct-config}`), so every step has its
own task and tag while the logic stays ddops' own: the same probe, the same remedy, the same
re-probe as `ddops provision` / `ddops recover`. It runs on the managed host, under an
interpreter that has ddops installed (`ansible_python_interpreter`), and acts on that host
through ops.host.transport.LocalTransport, below `ddops_sysroot` for a simulated host.

Where the CLI runs the whole chain in one process, here each step is a task: the chain's
bookkeeping (a check whose needs did not pass is skipped; after a failure the rest of that CT's
chain is skipped) travels between tasks in the host fact `ddops_chain_state`
({vmid: {"checks": {check: status}, "failed": "CT 200: ...: why" or null}}), which each call
reads (`state`) and returns updated. A check whose
needs were left out (`--tags`) counts as passed. In check mode a remedy only plans (its diff is
the task's --diff output) and the checks after it that need it are skipped, as in --dry-run:
such a task reports "skipping".

A CT that fails does not fail the task: the play's last task (ddops_verdict) fails the host
when any CT failed, after every CT has gone as far as it could.
"""

from __future__ import annotations

import dataclasses

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.ddops_host import host_sysroot

DOCUMENTATION = r"""
---
module: ddops_check
short_description: Run one check of the ddops chain for each GPU container of a Proxmox VE host
version_added: "0.1.0"
description:
  - Runs one check of ddops' chain (probe, then when it fails the check's remedy and a re-probe) for each selected
    GPU container (CT) of the managed host; the same probe and remedy as C(ddops provision) and C(ddops recover).
  - A play calls it once per check, in chain order (the C(ddops_chain) role of C(playbooks/provision.yml) and
    C(playbooks/recover.yml)), so every check has its own task and tags.
  - The chain's bookkeeping travels between the tasks in the host fact C(ddops_chain_state), which each call reads
    from O(state) and returns updated; a check whose needs did not pass is skipped, and after a failure the rest of
    that CT's chain is skipped. A need with no status (left out with C(--tags)) counts as passed when its own needs do.
  - A CT that fails does not fail the task; the play's last task fails the host when any CT failed, after every CT
    has gone as far as it could.
  - It acts on the managed host itself (below O(sysroot) for a simulated host), under the host's ddops lock whenever
    a remedy may change something.
options:
  check:
    description:
      - The key of the check to run, one of the chain's keys, C(host), C(modules), C(nodes), C(gpu-majors), C(ct-exists),
        C(ct-config),
        C(ct-running), C(cuda), C(model), C(service), C(engine), C(bench), C(host-ddops), and under
        O(mode=provision) also C(capacity), C(gpu-capacity), C(boot), C(hookscript), C(engine-installed), C(api-key).
      - The task fails when the check is not in the chain of O(mode).
    type: str
    required: true
  mode:
    description:
      - The chain's policy. V(provision) may create the CT, install its boot files and the engine and set the engine's
        API key; V(recover) only repairs what exists.
    type: str
    choices: [provision, recover]
    default: provision
  unlock:
    description:
      - Clear a CT lock (C(pct unlock)) before starting the CT.
    type: bool
    default: false
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
      - The model the engine serves, the C(ddops_model) inventory variable.
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
      - Only its simulated root (C(sim:PATH), C(?sysroot=PATH)) is used, when O(sysroot) is unset; the module always
        acts on the managed host.
    type: str
  vmids:
    description:
      - Run the check for these containers of O(containers) only; an empty list selects them all.
      - A vmid that is not in O(containers) selects nothing.
    type: list
    elements: int
    default: []
  state:
    description:
      - The host fact C(ddops_chain_state) from the earlier checks of the play, an empty mapping at the first check.
      - "Its form is C({VMID: {checks: {KEY: STATUS}, failed: WHY}}), where C(WHY) is the CT's first failure in words,
        or null."
    type: dict
    default: {}
  host_name:
    description:
      - The host's name in the one-host inventory the module builds, normally its C(inventory_hostname); the host's own
        site file names it so.
    type: str
    default: this
  hf_token:
    description:
      - A Hugging Face token, for a gated model (the C(model) check stages the model with it).
      - Secret; the module marks it no_log, so Ansible never logs or shows it.
    type: str
  api_key:
    description:
      - Under O(mode=provision), the engine API key to install (the C(DDOPS_API_KEY) the CLI reads); 1 to 4096 letters,
        digits or C(._~+/=:@-).
      - Without it, the key already installed is kept, or one is generated. V(recover) never touches the key.
      - Secret; the module marks it no_log, so Ansible never logs or shows it.
    type: str
  remove_api_key:
    description:
      - Under O(mode=provision), remove the engine's API key, so that it serves without authentication.
    type: bool
    default: false
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.facts
attributes:
  check_mode:
    support: full
    details:
      - Probes run (they only read); a remedy only plans, as C(ddops provision --dry-run) does. Its result is
        C(would change), with the plan in RV(results[].action) and any file change in RV(diff).
      - A later check that needs a planned one is skipped, and its task reports C(skipping).
  diff_mode:
    support: full
    details:
      - The unified diff of the files a remedy wrote, or would write in check mode, is RV(diff).
  facts:
    support: full
    details:
      - Returns C(ddops_chain_state) updated with this check's status for each CT.
  platform:
    platforms: posix
    details:
      - A Proxmox VE host, or a simulated one (a directory, on any POSIX machine).
notes:
  - The module runs on the managed host under an interpreter that has ddops installed (C(ansible_python_interpreter)).
  - It needs the C(ddops_host) module utility of the C(ddops_chain) role (its C(module_utils/), beside its C(library/)).
  - Give the inputs once with C(module_defaults), as the C(ddops_chain) role does, and only O(check) per task.
seealso:
  - module: ansible.legacy.ddops_boot_files
    description: The boot files the C(boot) check installs, for Ansible's own template module.
  - module: ansible.legacy.ddops_bench
    description: Bench the engines of a host's CTs, after the same chain's health check.
author:
  - ddops maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Host reachable
  ddops_check:
    check: host
    mode: recover
    containers: "{{ ddops_containers }}"
    model: "{{ ddops_model }}"
    host_name: "{{ inventory_hostname }}"

- name: CT config grants current majors, after the earlier checks of the play
  ddops_check:
    check: ct-config
    mode: recover
    containers: "{{ ddops_containers }}"
    model: "{{ ddops_model }}"
    engine: "{{ ddops_engine }}"
    state: "{{ ddops_chain_state | default({}) }}"
    host_name: "{{ inventory_hostname }}"

- name: Engine API key set on CT 200 of a simulated host, from the controller's environment
  ddops_check:
    check: api-key
    mode: provision
    containers: "{{ ddops_containers }}"
    model: "{{ ddops_model }}"
    target: "sim:/tmp/pve1"
    vmids: [200]
    state: "{{ ddops_chain_state | default({}) }}"
    api_key: "{{ lookup('ansible.builtin.env', 'DDOPS_API_KEY') | default(omit, true) }}"
    host_name: "{{ inventory_hostname }}"

- name: CT unlocked and running, clearing a stale lock first
  ddops_check:
    check: ct-running
    mode: recover
    unlock: true
    containers: "{{ ddops_containers }}"
    model: "{{ ddops_model }}"
    state: "{{ ddops_chain_state | default({}) }}"
    host_name: "{{ inventory_hostname }}"
"""

RETURN = r"""
results:
  description:
    - One entry per selected CT, the check's result there.
    - Empty when no CT is selected.
  returned: always
  type: list
  elements: dict
  contains:
    vmid:
      description: The CT's vmid.
      returned: always
      type: int
      sample: 200
    key:
      description: The check's key, as in O(check).
      returned: always
      type: str
      sample: ct-config
    title:
      description: The check's title.
      returned: always
      type: str
      sample: CT config grants current majors
    status:
      description:
        - V(ok) or V(unchanged) (the probe passed), V(changed) (the remedy fixed it), V(would change) (check mode
          planned a remedy), V(failed), or V(skipped) (its needs did not pass, or an earlier check of the CT failed).
      returned: always
      type: str
      sample: changed
    seconds:
      description: How long the probe, remedy and re-probe took.
      returned: always
      type: float
      sample: 0.42
    evidence:
      description: What the probe found, or why the check was skipped.
      returned: always
      type: str
      sample: "CT 200: the config grants the current majors"
    action:
      description: What the remedy did, or plans in check mode; empty when it did nothing.
      returned: always
      type: str
      sample: "wrote /etc/pve/lxc/200.conf (backup /var/lib/ddops/backups/etc__pve__lxc__200.conf.20261201T101500.123456789); restarted"
    diff:
      description: The unified diff of the files the remedy wrote, or would write; empty when none.
      returned: always
      type: str
      sample: "--- /etc/pve/lxc/200.conf\n+++ /etc/pve/lxc/200.conf\n@@ -9 +9 @@\n-lxc.cgroup2.devices.allow: c 508:* rwm\n+lxc.cgroup2.devices.allow: c 510:* rwm\n"
diff:
  description:
    - The CTs' file diffs together, as Ansible shows them with C(--diff); an empty mapping when no remedy wrote or
      planned a file change.
  returned: always
  type: dict
  contains:
    prepared:
      description: The unified diffs, one after another.
      returned: when a remedy wrote, or would write, a file
      type: str
      sample: "--- /etc/pve/lxc/200.conf\n+++ /etc/pve/lxc/200.conf\n@@ -9 +9 @@\n-lxc.cgroup2.devices.allow: c 508:* rwm\n+lxc.cgroup2.devices.allow: c 510:* rwm\n"
skipped:
  description: Whether every selected CT skipped the check (Ansible then reports the task as skipping).
  returned: always
  type: bool
  sample: false
ansible_facts:
  description: The facts the module sets on the host.
  returned: always
  type: dict
  contains:
    ddops_chain_state:
      description:
        - O(state) updated with this check's status for each selected CT; C(failed) is the CT's first failure in
          words, or null.
      returned: always
      type: dict
      sample:
        "200":
          checks: {host: unchanged, modules: unchanged, nodes: unchanged, ct-exists: unchanged, ct-config: changed}
          failed: null
"""

ARGUMENT_SPEC = {
    "check": {"type": "str", "required": True},
    "mode": {"type": "str", "choices": ["provision", "recover"], "default": "provision"},
    "unlock": {"type": "bool", "default": False},
    "containers": {"type": "list", "elements": "dict", "required": True},
    "model": {"type": "dict", "required": True},
    "engine": {"type": "dict", "default": {}},
    "sysroot": {"type": "str"},
    "target": {"type": "str"},
    "vmids": {"type": "list", "elements": "int", "default": []},
    "state": {"type": "dict", "default": {}},
    "host_name": {"type": "str", "default": "this"},
    "hf_token": {"type": "str", "no_log": True},
    "api_key": {"type": "str", "no_log": True},
    "remove_api_key": {"type": "bool", "default": False},
}

PASSED = ("ok", "unchanged", "changed")


def chain_context(params: dict, vmid_filter: list[int]):
    """One ChainContext per selected container, built through ddops' own inventory validation
    (its policy is set per check by ops.chain.runner.chain_run)."""
    from ops.chain.checks import ChainContext
    from ops.chain.deploy import parse_api_key
    from ops.errors import DdopsError
    from ops.host.transport import LocalTransport
    from ops.site.inventory import parse_site

    document = {
        "all": {
            "vars": {"ddops_model": params["model"], "ddops_engine": params["engine"]},
            "hosts": {
                params["host_name"]: {
                    "ddops_target": "local",
                    "ddops_containers": params["containers"],
                }
            },
        }
    }
    site = parse_site(document, "ansible host vars")
    (host,) = site.hosts
    t = LocalTransport(sysroot=host_sysroot(params["sysroot"], params["target"]))
    provision = params["mode"] == "provision"
    try:  # recover never touches the key: it keeps what is installed
        api_key = parse_api_key(params["api_key"]) if provision and params["api_key"] else None
    except ValueError as exc:
        raise DdopsError("api_key", str(exc)) from None
    return t, [
        ChainContext(
            t=t,
            ct=ct,
            model=site.model,
            engine=site.engine,
            host=host,
            hf_token=params["hf_token"] or None,
            api_key=api_key,
        )
        for ct in host.containers
        if not vmid_filter or ct.vmid in vmid_filter
    ]


def unmet_needs(check, statuses: dict[str, str], checks: dict) -> list[str]:
    """The needs of `check` that did not pass. A need with no status (left out with --tags, or
    skipped: Ansible keeps no facts from a skipped task) passes when its own needs do."""
    unmet = []
    for need in check.needs:
        status = statuses.get(need)
        if status is None:
            if need in checks and unmet_needs(checks[need], statuses, checks):
                unmet.append(need)
        elif status not in PASSED:
            unmet.append(need)
    return unmet


def blocked_by(check, statuses: dict[str, str], checks: dict) -> str | None:
    """Why this CT's chain does not reach `check` (None: it does), from the earlier statuses."""
    if "failed" in statuses.values():
        return "an earlier check failed"
    missing = unmet_needs(check, statuses, checks)
    return f"needs {', '.join(missing)}" if missing else None


def run_check(check, c, statuses: dict[str, str], params: dict, dry_run: bool, checks: dict):
    """The chain's probe -> remedy -> re-probe for one CT: ops.chain.runner.run_check, in a run
    that ops.chain.runner.chain_run sets up (the policy of the play's mode and options, the host
    lock while it may change something), as ops.chain.runner.run_chain runs it."""
    from ops.chain.report import CheckResult
    from ops.chain.runner import chain_run
    from ops.chain.runner import run_check as run_one

    if (why := blocked_by(check, statuses, checks)) is not None:
        return CheckResult(check.key, check.title, "skipped", 0.0, why)
    options = {"unlock": params["unlock"], "remove_api_key": params["remove_api_key"]}
    with chain_run(c, params["mode"], dry_run, **options) as c:
        return run_one(check, c, repair=True, dry_run=dry_run)


def _ct_state(earlier: dict) -> dict:
    """One CT's entry in ddops_chain_state: each check's status, and its failure in words."""
    return {"checks": dict(earlier.get("checks") or {}), "failed": earlier.get("failed")}


def main() -> None:
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        supports_check_mode=True,
    )
    from ops.chain.checks import chain_for
    from ops.errors import DdopsError

    params = module.params
    try:
        t, contexts = chain_context(params, params["vmids"])
    except DdopsError as exc:
        module.fail_json(msg=str(exc))
    checks = {check.key: check for check in chain_for(params["mode"])} if contexts else {}
    if contexts and params["check"] not in checks:
        module.fail_json(msg=f"check {params['check']!r} is not in the {params['mode']} chain")
    state = {str(vmid): _ct_state(ct) for vmid, ct in params["state"].items()}
    results = []
    try:
        for c in contexts:
            ct = state.setdefault(str(c.vmid), _ct_state({}))
            check = checks[params["check"]]
            result = run_check(check, c, ct["checks"], params, module.check_mode, checks)
            ct["checks"][result.key] = result.status
            if result.status == "failed":
                ct["failed"] = f"CT {c.vmid}: {result.title}: {result.action or result.evidence}"
            results.append({"vmid": c.vmid, **dataclasses.asdict(result)})
    finally:
        t.close()
    diff = "".join(r["diff"] for r in results)
    module.exit_json(
        # "skipping", as Ansible users expect, when no CT reached this check (e.g. in check mode
        # after a planned `pct create`); its statuses are rebuilt from the needs (unmet_needs).
        skipped=bool(results) and all(r["status"] == "skipped" for r in results),
        changed=any(r["status"] in ("changed", "would change") for r in results),
        results=results,
        diff={"prepared": diff} if diff else {},
        ansible_facts={"ddops_chain_state": state},
    )


if __name__ == "__main__":
    main()
