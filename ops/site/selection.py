"""The CLI's -i/--host turned into the containers to act on: a Site, and one Transport per host.

    with open_site(inventory="site.yml", host=None, vmids=[200]) as opened:
        for target in opened.targets:        # CtTarget: host spec, container spec, transport
            ...

With an inventory, `--host` narrows it to the host of that name or target. With `--host sim:PATH`
and no inventory, the caller's `default_site(host, vmids)` makes the site (the CLI passes the
simulated host's: ops/sim/default_site.py, the demo pair from the host's own hub; this module
never imports the sim). Other hosts need an inventory: only it says which model to serve.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import click

from ops.errors import DdopsError, InputError
from ops.host.targets import open_transport, parse_target, shown_target
from ops.host.transport import Transport
from ops.site.inventory import ContainerSpec, HostSpec, Site, load_site

DefaultSite = Callable[[str, Sequence[int]], Site]  # (host, vmids) -> the site without inventory


@dataclass(frozen=True)
class CtTarget:
    """One container to act on: where it lives and how to reach its host."""

    host: HostSpec
    ct: ContainerSpec
    t: Transport


@dataclass(frozen=True)
class OpenedSite:
    site: Site
    inventory_path: str | None  # absolute; what the boot units on the host pass to ddops
    targets: tuple[CtTarget, ...]


def results_dir() -> Path:
    """Where bench results live on this machine: $DDOPS_RESULTS, else <ddops home>/results."""
    if explicit := os.environ.get("DDOPS_RESULTS"):
        return Path(explicit)
    home = os.environ.get("DDOPS_HOME") or click.get_app_dir("ddops")
    return Path(home) / "results"


@contextlib.contextmanager
def open_site(
    *,
    inventory: str | None,
    host: str | None,
    vmids: Sequence[int] = (),
    accept_new_host_key: bool = False,
    default_site: DefaultSite | None = None,
) -> Iterator[OpenedSite]:
    """The containers named by `vmids` (all of the site's when empty), their transports open."""
    with contextlib.ExitStack() as stack:
        if inventory:
            site = _narrowed(load_site(inventory), host)
            inventory_path = os.path.abspath(inventory)
        elif host:
            site = _default_site(host, vmids, default_site)
            inventory_path = None
        else:
            raise DdopsError("ddops", "name the site: -i INVENTORY (or DDOPS_INVENTORY) or --host")
        transports: dict[str, Transport] = {}
        targets = []
        for host_spec, ct in _selected(site, vmids):
            if host_spec.name not in transports:
                t = open_transport(host_spec.target, accept_new_host_key=accept_new_host_key)
                stack.callback(t.close)
                transports[host_spec.name] = t
            targets.append(CtTarget(host_spec, ct, transports[host_spec.name]))
        yield OpenedSite(site, inventory_path, tuple(targets))


def _narrowed(site: Site, host: str | None) -> Site:
    if host is None:
        return site
    hosts = tuple(h for h in site.hosts if host in (h.name, h.target))
    if not hosts:
        raise InputError(
            f"host {shown_target(host)}", "not in the inventory (by name or ddops_target)"
        )
    return Site(hosts, site.model, site.engine)


def _selected(site: Site, vmids: Sequence[int]) -> list[tuple[HostSpec, ContainerSpec]]:
    if vmids:
        return [site.find_container(vmid) for vmid in vmids]
    selected = [(h, ct) for h in site.hosts for ct in h.containers]
    if not selected:
        raise DdopsError("inventory", "no containers (ddops_containers) to act on")
    return selected


def _default_site(host: str, vmids: Sequence[int], default_site: DefaultSite | None) -> Site:
    """A sim host's default site, from the caller's `default_site`."""
    if parse_target(host).kind != "sim" or default_site is None:
        raise InputError(
            f"host {shown_target(host)}",
            "without an inventory only sim:PATH hosts have a default site: -i",
        )
    if not vmids:
        raise DdopsError(f"host {host!r}", "name the container with --ct (there is no inventory)")
    return default_site(host, vmids)
