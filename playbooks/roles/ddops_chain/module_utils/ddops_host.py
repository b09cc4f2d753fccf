"""Shared by the ddops modules (the ddops_chain role's library/): where the managed host's files live.

A simulated Proxmox host (ops/sim) is a directory: `ddops_sysroot` names it, or the host's
`ddops_target` does (`sim:PATH`, `ssh://host?sysroot=PATH`), the same variable the CLI reads.
"""

from __future__ import annotations


def host_sysroot(sysroot: str | None, target: str | None) -> str | None:
    """The root of a simulated host, or None for a real one."""
    if sysroot:
        return sysroot
    if not target:
        return None
    from ops.host.targets import parse_target

    return parse_target(target).sysroot
