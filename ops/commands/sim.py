"""`ddops sim`: create, reboot and destroy a simulated Proxmox VE host (see ops/sim).

ddops sim init /tmp/pve1 --gpus 2 --ct 200     # a healthy host, CT 200 running (onboot: 1)
ddops sim reboot /tmp/pve1 --uvm-major 509     # the incident: uvm nodes gone, major changed
ddops --host sim:/tmp/pve1 health --ct 200     # then look at it like any host
ddops sim upgrade /tmp/pve1 --kernel 7.0.14-9-pve --dkms fail   # a kernel the driver fails on
ddops sim upgrade /tmp/pve1 --driver 590.48.02  # a new driver, loaded at the next boot
ddops sim destroy /tmp/pve1
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import click

from ops.commands.shared import VMID
from ops.errors import InputError
from ops.sim.host import destroy_host, init_host, reboot_host, upgrade_host
from ops.sim.release import DEFAULT_PVE_VERSION
from ops.sim.state import load_state

UVM_MAJOR = click.IntRange(234, 511)
KERNEL_VERSION = re.compile(r"\d+\.\d+\.\d+-\d+-pve")
DRIVER_VERSION = re.compile(r"\d{3}\.\d{1,3}(?:\.\d{1,3})?")


def _emit(ctx: click.Context, document: dict, human: str) -> None:
    click.echo(json.dumps(document, indent=2) if ctx.obj.json else human)


@click.group()
def sim() -> None:
    """A simulated Proxmox VE host: real LXC containers, fake GPUs."""


@sim.command()
@click.argument("path", type=click.Path(file_okay=False, path_type=Path))
@click.option("--gpus", default=1, show_default=True, type=click.IntRange(1, 16))
@click.option(
    "--gpu-memory-mib",
    default=97887,
    show_default=True,
    type=click.IntRange(1024, 4 << 20),
    help="Each fake GPU's memory (nvidia-smi memory.total); 97887 is a 96 GB card.",
)
@click.option("--uvm-major", default=511, show_default=True, type=UVM_MAJOR)
@click.option(
    "--pve-version",
    default=DEFAULT_PVE_VERSION,
    show_default=True,
    help="Proxmox VE release: 9.x (kernel 6.14-7.0, unprivileged CTs) or 8.x/7.x (kernel 6.8).",
)
@click.option("--driver", help="NVIDIA driver version (default: the release's; open from 560).")
@click.option(
    "--containers",
    type=click.Choice(["auto", "lxc", "process"]),
    default="auto",
    show_default=True,
    help="Real LXC containers (root + lxc) or plain processes; auto picks lxc where possible.",
)
@click.option(
    "--module",
    "module_flavour",
    type=click.Choice(["open", "proprietary"]),
    help="The driver's kernel module flavour (default: open from 560, as NVIDIA installs it).",
)
@click.option(
    "--container-toolkit/--no-container-toolkit",
    default=None,
    help="The host has libnvidia-container, for LXC's NVIDIA mount hook (default: on PVE 9).",
)
@click.option("--ct", type=VMID, help="Also create and start this CT.")
@click.pass_context
def init(
    ctx,
    path: Path,
    gpus,
    gpu_memory_mib,
    uvm_major,
    pve_version,
    driver,
    containers,
    module_flavour,
    container_toolkit,
    ct,
):
    """Make PATH a simulated Proxmox host (a no-op when it already is one)."""
    path = path.resolve()
    if driver:
        _check(DRIVER_VERSION, driver, "--driver", "590.48.01")
    changed = init_host(
        path,
        gpus=gpus,
        gpu_memory_mib=gpu_memory_mib,
        uvm_major=uvm_major,
        pve_version=pve_version,
        driver=driver,
        containers=containers,
        ct=ct,
        container_toolkit=container_toolkit,
        open_module=None if module_flavour is None else module_flavour == "open",
    )
    state = load_state(path)
    document = {"path": str(path), "changed": changed, **asdict(state)}
    if changed:
        human = (
            f"{path}: simulated Proxmox VE {state.pve_version} host created: kernel {state.kernel}, "
            f"{state.gpus} GPU(s), driver {state.driver_version} "
            f"({'open' if state.open_module else 'proprietary'} module), uvm major {state.uvm_major}, "
            f"containers: {state.containers}" + (f", CT {ct} running" if ct else "")
        )
    else:
        human = f"{path}: already a simulated host: unchanged"
    _emit(ctx, document, human)


@sim.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--uvm-major", type=UVM_MAJOR, help="The uvm major after boot (default: a new one).")
@click.pass_context
def reboot(ctx, path: Path, uvm_major) -> None:
    """Reboot the simulated host: CTs stop, /dev/shm empties, uvm nodes vanish, onboot CTs start."""
    report = reboot_host(path.resolve(), uvm_major=uvm_major)
    lines = [
        f"{path}: rebooted: uvm major {report.uvm_major_before} -> {report.uvm_major}",
        f"  kernel: {report.kernel}",
        f"  modules loaded: {', '.join(report.modules) or 'none'}",
        f"  boot units run: {', '.join(report.units) or 'none'}",
        f"  CTs stopped: {_ids(report.stopped)}; started (onboot): {_ids(report.started)}",
    ]
    lines += [f"  CT {vmid}: start failed: {why}" for vmid, why in report.failed.items()]
    _emit(ctx, {"path": str(path.resolve()), **asdict(report)}, "\n".join(lines))


@sim.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--kernel", "kernel_version", help="Install this kernel, e.g. 7.0.14-9-pve.")
@click.option(
    "--dkms",
    type=click.Choice(["ok", "fail"]),
    default="ok",
    show_default=True,
    help="Whether the NVIDIA DKMS build for the new kernel succeeds.",
)
@click.option(
    "--driver", help="Install this NVIDIA driver (built for every kernel; loaded at boot)."
)
@click.pass_context
def upgrade(ctx, path: Path, kernel_version, dkms, driver) -> None:
    """Upgrade the simulated host's kernel or NVIDIA driver, as apt would (no reboot)."""
    if bool(kernel_version) == bool(driver):
        raise InputError("sim upgrade", "give one of --kernel VERSION or --driver VERSION")
    if kernel_version:
        _check(KERNEL_VERSION, kernel_version, "--kernel", "7.0.14-9-pve")
    else:
        _check(DRIVER_VERSION, driver, "--driver", "590.48.02")
    report = upgrade_host(
        path.resolve(), kernel_version=kernel_version, dkms_ok=dkms == "ok", driver=driver
    )
    what = f"kernel {kernel_version}" if kernel_version else f"driver {driver}"
    lines = [f"{path}: installed {what} (takes effect at the next boot)"]
    lines += [f"  dkms nvidia on {kernel}: {said}" for kernel, said in report.built.items()]
    lines += [f"  /etc/kernel/postinst.d/{hook}" for hook in report.hooks]
    _emit(ctx, {"path": str(path.resolve()), **asdict(report)}, "\n".join(lines))


def _check(pattern: re.Pattern, value: str, option: str, example: str) -> None:
    if not pattern.fullmatch(value):
        raise InputError("sim", f"{option} {value!r}: expected a version like {example}")


@sim.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.pass_context
def destroy(ctx, path: Path) -> None:
    """Stop and destroy the host's containers, then delete PATH."""
    destroyed = destroy_host(path.resolve())
    _emit(
        ctx,
        {"path": str(path.resolve()), "destroyed": destroyed},
        f"{path}: simulated host destroyed (CTs: {_ids(destroyed)})",
    )


def _ids(vmids: list[int]) -> str:
    return ", ".join(map(str, vmids)) or "none"
