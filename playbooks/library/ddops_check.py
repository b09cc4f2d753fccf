#!/usr/bin/python
"""Ansible module: run one check of ddops' chain (ops/checks.py) for each container of a host.

The playbooks call it once per step (`ddops_check: {check: ct-config}`), so every step has its
own task and tag while the logic stays ddops' own: the same probe, the same remedy, the same
re-probe as `ddops provision` / `ddops recover`. It runs on the managed host, under an
interpreter that has ddops installed (`ansible_python_interpreter`), and acts on that host
through ops.transport.LocalTransport, below `ddops_sysroot` for a simulated host.

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
module: ddops_check
short_description: Run one check of the ddops chain for each container of a Proxmox host
options:
  check: {description: the check's key (host, modules, nodes, ct-config, ...), required: true, type: str}
  mode: {description: provision (may create) or recover, choices: [provision, recover], default: provision, type: str}
  unlock: {description: clear a CT lock before starting it, default: false, type: bool}
  containers: {description: the host's ddops_containers, required: true, type: list, elements: dict}
  model: {description: ddops_model, required: true, type: dict}
  engine: {description: ddops_engine, default: {}, type: dict}
  sysroot: {description: root of a simulated host (ddops_sysroot), type: str}
  target: {description: the host's ddops_target (its ?sysroot= or sim:PATH is used when sysroot is unset), type: str}
  vmids: {description: only these containers (default all), default: [], type: list, elements: int}
  state: {description: ddops_chain_state from the earlier steps, default: {}, type: dict}
  host_name: {description: "the host's inventory name (inventory_hostname): the host's own site file names it", default: this, type: str}
  hf_token: {description: Hugging Face token for gated models, type: str}
  api_key: {description: "provision: the engine API key to install (DDOPS_API_KEY); without it the installed key is kept, or one is generated", type: str}
  remove_api_key: {description: "provision: remove the engine's API key (serve without authentication)", default: false, type: bool}
"""

RETURN = r"""
results: {description: one entry per CT, with vmid, key, title, status, seconds, evidence, action, diff, type: list}
ansible_facts: {description: ddops_chain_state updated with this check's statuses, type: dict}
"""

PASSED = ("ok", "unchanged", "changed")


def chain_context(params: dict, vmid_filter: list[int]):
    """One ChainContext per selected container, built through ddops' own inventory validation."""
    from ops.checks import ChainContext, Policy
    from ops.deploy import parse_api_key
    from ops.errors import DdopsError
    from ops.inventory import parse_site
    from ops.transport import LocalTransport

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
    policy = Policy(
        provision=provision,
        unlock=params["unlock"],
        remove_api_key=provision and params["remove_api_key"],
    )
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
            policy=policy,
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


def run_check(check, c, statuses: dict[str, str], dry_run: bool, checks: dict):
    """The chain's probe -> remedy -> re-probe for one CT: ops.recover.run_check, under the
    host lock when it may change something (as ops.recover.run_chain runs it)."""
    from ops.recover import CheckResult, host_lock
    from ops.recover import run_check as run_one

    if (why := blocked_by(check, statuses, checks)) is not None:
        return CheckResult(check.key, check.title, "skipped", 0.0, why)
    if dry_run:
        return run_one(check, c, repair=True, dry_run=True)
    with host_lock(c.t):
        return run_one(check, c, repair=True)


def _ct_state(earlier: dict) -> dict:
    """One CT's entry in ddops_chain_state: each check's status, and its failure in words."""
    return {"checks": dict(earlier.get("checks") or {}), "failed": earlier.get("failed")}


def main() -> None:
    module = AnsibleModule(
        argument_spec={
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
        },
        supports_check_mode=True,
    )
    from ops.checks import chain_for
    from ops.errors import DdopsError

    params = module.params
    try:
        t, contexts = chain_context(params, params["vmids"])
    except DdopsError as exc:
        module.fail_json(msg=str(exc))
    checks = {check.key: check for check in chain_for(contexts[0].policy)} if contexts else {}
    if contexts and params["check"] not in checks:
        module.fail_json(msg=f"check {params['check']!r} is not in the {params['mode']} chain")
    state = {str(vmid): _ct_state(ct) for vmid, ct in params["state"].items()}
    results = []
    try:
        for c in contexts:
            ct = state.setdefault(str(c.vmid), _ct_state({}))
            check = checks[params["check"]]
            result = run_check(check, c, ct["checks"], module.check_mode, checks)
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
