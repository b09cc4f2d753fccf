"""The CLI's -i/--host turned into the containers to act on: a Site, and one Transport per host.

    with open_site(inventory="site.yml", host=None, vmids=[200]) as opened:
        for target in opened.targets:        # CtTarget: host spec, container spec, transport
            ...

With an inventory, `--host` narrows it to the host of that name or target. With `--host sim:PATH`
and no inventory, a default site fitted to this machine is made: one container per `--ct`, the
shipped demo model pair (engine/demo_model/{target,draft}) served by a local hub that lives as
long as the `with` block, and the engine on this Python (float32 on the CPU). Other hosts need
an inventory: only it says which model to serve.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import click

from ops.errors import DdopsError, InputError
from ops.host.targets import open_transport, parse_target, shown_target
from ops.host.transport import Transport
from ops.site.inventory import (
    ContainerSpec,
    EngineSpec,
    HostSpec,
    ModelRef,
    ModelSpec,
    Site,
    load_site,
)

DEMO_MODEL_DIR = Path(__file__).resolve().parents[2] / "engine" / "demo_model"
DEMO_REPOS = {"target": "ddops/demo-target", "draft": "ddops/demo-draft"}
DEMO_ENGINE = {"method": "ddtree", "budget": 15, "max_model_len": 2048}


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
) -> Iterator[OpenedSite]:
    """The containers named by `vmids` (all of the site's when empty), their transports open."""
    with contextlib.ExitStack() as stack:
        if inventory:
            site = _narrowed(load_site(inventory), host)
            inventory_path = os.path.abspath(inventory)
        elif host:
            site = stack.enter_context(_default_site(host, vmids))
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


@contextlib.contextmanager
def _default_site(host: str, vmids: Sequence[int]) -> Iterator[Site]:
    """A sim host's default site: the demo pair from a local hub, the engine on this Python."""
    if parse_target(host).kind != "sim":
        raise InputError(
            f"host {shown_target(host)}",
            "without an inventory only sim:PATH hosts have a default site: -i",
        )
    if not vmids:
        raise DdopsError(f"host {host!r}", "name the container with --ct (there is no inventory)")
    if not all((DEMO_MODEL_DIR / part / "config.json").is_file() for part in DEMO_REPOS):
        raise DdopsError(
            str(DEMO_MODEL_DIR), "the demo model pair is not in this checkout: use -i INVENTORY"
        )
    from ops.sim.hub import LocalHub  # the sim is only for sim hosts

    with tempfile.TemporaryDirectory(prefix="ddops-demo-hub-") as hub_root:
        for part, repo in DEMO_REPOS.items():
            (Path(hub_root) / repo).parent.mkdir(parents=True, exist_ok=True)
            (Path(hub_root) / repo).symlink_to(DEMO_MODEL_DIR / part)
        with LocalHub(hub_root) as hub:
            model = ModelSpec(
                target=ModelRef(DEMO_REPOS["target"], name="target"),
                draft=ModelRef(DEMO_REPOS["draft"], name="draft"),
                hub_endpoint=hub.url,
            )
            engine = EngineSpec(**DEMO_ENGINE, dtype="float32", device="cpu", python=sys.executable)
            containers = tuple(ContainerSpec(vmid) for vmid in vmids)
            yield Site((HostSpec("sim", host, containers),), model, engine)
