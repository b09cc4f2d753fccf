#!/usr/bin/python
"""Ansible module: the boot files `ddops provision` installs on a host, as template variables.

Read-only. It asks ddops (ops.chain.setup.boot_specs) which files make a booted host recover its
GPU containers, and returns for each: its template under templates/, its variables and where it
goes on the host (below `sysroot` for a simulated host). The play then renders them with
Ansible's own `template` module from the same template files, so the playbook and the CLI write
byte-identical files from one source (tests/integration/test_ansible.py checks it).
"""

from __future__ import annotations

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.ddops_host import host_sysroot

DOCUMENTATION = r"""
---
module: ddops_boot_files
short_description: The boot files (modules-load, GPU-node unit, recover unit) ddops installs on a Proxmox VE host
version_added: "0.1.0"
description:
  - Read-only; computes, for the host's GPU containers (CTs), the files that make a booted host recover them
    without a person, the same files C(ddops provision) installs.
  - For each file it returns its template (under ddops' C(templates/)), the template's variables, where the file goes
    on the host (below the simulated root for a simulated host) and, for a systemd unit, the unit's name.
  - A play then renders them with M(ansible.builtin.template) from the same template files, so that the playbook and
    the CLI write byte-identical files from one source.
options:
  containers:
    description:
      - The host's containers, its C(ddops_containers) inventory variable.
      - Each is a mapping with a C(vmid) and the CT's other settings (C(hostname), C(cores), C(memory_mib), C(gpus),
        ...). The GPU-node unit creates the nodes of every GPU the CTs use; the recover unit recovers every CT.
      - The task fails on a setting ddops does not know or rejects.
    type: list
    elements: dict
    required: true
  sysroot:
    description:
      - The root directory of a simulated host (the C(ddops_sysroot) inventory variable); every file's C(dest) falls
        below it.
      - When unset, the one of O(target) is used; a real host has none.
    type: str
  target:
    description:
      - The host's C(ddops_target) inventory variable (C(local), C(sim:PATH), C(ssh://[user@]host[:port][?sysroot=PATH])).
      - Only its simulated root (C(sim:PATH), C(?sysroot=PATH)) is used, when O(sysroot) is unset.
    type: str
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details:
      - The module only computes, so it runs the same in check mode. Run it with C(check_mode=false) so that the
        template tasks after it have their variables in a check run too.
  diff_mode:
    support: none
    details:
      - It writes nothing; the template tasks that render its files show their own diffs.
  platform:
    platforms: posix
    details:
      - A Proxmox VE host, or a simulated one (a directory, on any POSIX machine).
notes:
  - The module runs on the managed host under an interpreter that has ddops installed (C(ansible_python_interpreter)).
  - It needs the C(ddops_host) module utility of the C(ddops_chain) role (its C(module_utils/), beside its C(library/)).
  - It never reports C(changed).
seealso:
  - module: ansible.builtin.template
    description: Renders each of RV(files) from its C(template) with its C(variables).
  - module: ansible.legacy.ddops_check
    description: The same files are what C(ddops provision)'s C(boot) check installs.
author:
  - ddops maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Boot files ddops wants on this host
  ddops_boot_files:
    containers: "{{ ddops_containers }}"
  check_mode: false  # read-only: it only computes
  register: ddops_boot

- name: Boot files of a simulated host, below its root
  ddops_boot_files:
    containers:
      - {vmid: 200, gpus: [0]}
      - {vmid: 201, gpus: [1]}
    target: "sim:/tmp/pve1"
  register: ddops_boot
"""

RETURN = r"""
files:
  description:
    - The boot files, by name (the template's name without C(.j2)); each with C(template), C(dest), C(unit) and
      C(variables).
  returned: success
  type: dict
  contains:
    nvidia-modules.conf:
      description:
        - The modules-load.d file that loads the NVIDIA kernel modules at boot; C(unit) is null.
        - Its variables are C(modules), the kernel modules to load.
      returned: success
      type: dict
      sample:
        template: nvidia-modules.conf.j2
        dest: /etc/modules-load.d/ddops-nvidia.conf
        unit: null
        variables: {modules: [nvidia, nvidia_uvm]}
    ddops-gpu-nodes.service:
      description:
        - The boot unit that creates the C(/dev/nvidia*) and C(/dev/nvidia-uvm) nodes before C(pve-guests.service).
        - Its variables are C(nvidia_modprobe) (the path of C(nvidia-modprobe)), C(gpu_minors) (the GPUs the CTs use)
          and C(modeset).
      returned: success
      type: dict
      sample:
        template: ddops-gpu-nodes.service.j2
        dest: /etc/systemd/system/ddops-gpu-nodes.service
        unit: ddops-gpu-nodes.service
        variables: {nvidia_modprobe: /usr/bin/nvidia-modprobe, gpu_minors: [0, 1], modeset: true}
    ddops-recover.service:
      description:
        - The boot unit that runs the host's own C(ddops recover --at-boot) for the CTs after C(pve-guests.service).
        - Its variables are C(vmids), C(ddops) (the host's ddops), C(inventory) (the host's site file), C(timeout_s)
          and C(env_file) (where a stored C(HF_TOKEN) is read from).
      returned: success
      type: dict
      sample:
        template: ddops-recover.service.j2
        dest: /etc/systemd/system/ddops-recover.service
        unit: ddops-recover.service
        variables:
          vmids: [200, 201]
          ddops: /usr/local/bin/ddops
          inventory: /etc/ddops/site.yml
          timeout_s: 1800
          env_file: /etc/ddops/hf-token.env
sysroot:
  description: The simulated host's root, which every file's C(dest) falls below; empty for a real host.
  returned: success
  type: str
  sample: /tmp/pve1
"""

ARGUMENT_SPEC = {
    "containers": {"type": "list", "elements": "dict", "required": True},
    "sysroot": {"type": "str"},
    "target": {"type": "str"},
}


def boot_files(containers: list[dict], sysroot: str | None) -> dict:
    """{name: {template, dest, unit, variables}} for the host's containers."""
    from ops.chain.setup import boot_specs
    from ops.host.kernels import PIN_RECORD
    from ops.site.inventory import ContainerSpec

    cts = [ContainerSpec(**ct) for ct in containers]
    gpus = tuple(sorted({gpu for ct in cts for gpu in ct.gpus}))
    files = {}
    pin_record = f"{sysroot or ''}{PIN_RECORD}"  # where the hook, run on the host, finds it
    for spec in boot_specs(gpus, tuple(ct.vmid for ct in cts), pin_record):
        unit = spec.INSTALL_PATH.rsplit("/", 1)[1]
        files[spec.TEMPLATE.removesuffix(".j2")] = {
            "template": spec.TEMPLATE,
            "dest": f"{sysroot or ''}{spec.INSTALL_PATH}",
            "unit": unit if unit.endswith(".service") else None,
            "mode": f"{spec.MODE:04o}",
            "variables": spec.variables(),
        }
    return files


def main() -> None:
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
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
