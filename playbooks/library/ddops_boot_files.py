#!/usr/bin/python
"""Ansible module: the boot files `ddops provision` installs on a host, as template variables.

Read-only. It asks ddops (ops.host_setup.boot_specs) which files make a booted host recover its
GPU containers, and returns for each: its template under templates/, its variables and where it
goes on the host (below `sysroot` for a simulated host). The play then renders them with
Ansible's own `template` module from the same template files, so the playbook and the CLI write
byte-identical files from one source (tests/test_ansible.py checks it).
"""

from __future__ import annotations

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.ddops_host import host_sysroot

DOCUMENTATION = r"""
module: ddops_boot_files
short_description: The boot files (modules-load, GPU-node unit, recover unit) ddops installs
options:
  containers: {description: the host's ddops_containers, required: true, type: list, elements: dict}
  sysroot: {description: root of a simulated host, type: str}
  target: {description: the host's ddops_target (its sysroot is used when sysroot is unset), type: str}
"""

RETURN = r"""
files: {description: "a mapping name -> {template, dest, unit, variables}: name is the template without .j2", type: dict}
"""


def boot_files(containers: list[dict], sysroot: str | None) -> dict:
    """{name: {template, dest, unit, variables}} for the host's containers."""
    from ops.host_setup import boot_specs
    from ops.inventory import ContainerSpec

    cts = [ContainerSpec(**ct) for ct in containers]
    gpus = tuple(sorted({gpu for ct in cts for gpu in ct.gpus}))
    files = {}
    for spec in boot_specs(gpus, tuple(ct.vmid for ct in cts)):
        unit = spec.INSTALL_PATH.rsplit("/", 1)[1]
        files[spec.TEMPLATE.removesuffix(".j2")] = {
            "template": spec.TEMPLATE,
            "dest": f"{sysroot or ''}{spec.INSTALL_PATH}",
            "unit": unit if unit.endswith(".service") else None,
            "variables": spec.variables(),
        }
    return files


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "containers": {"type": "list", "elements": "dict", "required": True},
            "sysroot": {"type": "str"},
            "target": {"type": "str"},
        },
        supports_check_mode=True,
    )
    from ops.errors import DdopsError

    params = module.params
    try:
        sysroot = host_sysroot(params["sysroot"], params["target"])
        files = boot_files(params["containers"], sysroot)
    except (DdopsError, TypeError) as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(changed=False, files=files, sysroot=sysroot or "")


if __name__ == "__main__":
    main()
