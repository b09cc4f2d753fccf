"""What the sim's boot honours besides the kernel: modules-load.d and the units ddops installs.

Modules: every non-comment line of PATH/etc/modules-load.d/*.conf names a module to load.

Units: a unit PATH/etc/systemd/system/<name>.service runs at boot when it is enabled (a link or
file named <name>.service in some PATH/etc/systemd/system/*.wants/ directory). Of the unit, the
sim honours `ExecStart=` lines (in order; a leading `-` ignores the command's failure) and its
order against the guests: a unit with `After=pve-guests.service` runs after the `onboot: 1` CTs
have started, every other unit after the modules load and before the CTs start (as
`Before=pve-guests.service` orders it on a real host). Only commands the simulated host can run
are executed: its own tools (nvidia-modprobe, modprobe, ...), run from PATH/usr/{s,}bin, and
`ddops` as installed on the host (PATH/usr/local/bin/ddops, what `ddops provision` puts there),
whose `--host` becomes `--host sim:PATH` and whose host paths (`-i /etc/ddops/site.yml`) are read
below PATH. `EnvironmentFile=` is read raw, as systemd reads it (a quoted path is ignored).
Any other command, and a ddops the host does not have, is logged as skipped: the sim
runs on a real machine and never executes arbitrary boot commands on it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from ops.sim.executables import HOST_TOOLS
from ops.sim.state import log

UNIT_DIR = "etc/systemd/system"


def modules_to_load(root: Path) -> list[str]:
    names = []
    for conf in sorted((root / "etc/modules-load.d").glob("*.conf")):
        for line in conf.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith(";"):
                names.append(line.replace("-", "_"))
    return names


def enabled_units(root: Path) -> list[Path]:
    unit_dir = root / UNIT_DIR
    wanted = {link.name for link in unit_dir.glob("*.wants/*.service")}
    return [unit for unit in sorted(unit_dir.glob("*.service")) if unit.name in wanted]


def exec_starts(unit: Path) -> list[str]:
    # systemd allows repeated keys (configparser does not): read the [Service] lines directly.
    in_service = False
    lines = []
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if line.startswith("["):
            in_service = line == "[Service]"
        elif in_service and line.startswith("ExecStart="):
            lines.append(line.removeprefix("ExecStart=").strip())
    return lines


def after_guests(unit: Path) -> bool:
    """Whether the unit is ordered after pve-guests.service (runs once the onboot CTs are up)."""
    return any(
        line.strip().startswith("After=") and "pve-guests.service" in line
        for line in unit.read_text().splitlines()
    )


def run_boot_units(root: Path, *, after_guests_started: bool) -> list[str]:
    """Run the enabled units of one phase (before or after the guests start); those that ran."""
    ran = []
    for unit in enabled_units(root):
        if after_guests(unit) == after_guests_started and _run_unit(root, unit):
            ran.append(unit.stem)
    return ran


def _run_unit(root: Path, unit: Path) -> bool:
    """Run the unit's commands in order, stopping at a failure as systemd does; whether any ran."""
    ran_any = False
    for command in exec_starts(unit):
        argv = _sim_argv(root, shlex.split(command.lstrip("-")))
        if argv is None:
            log(root, f"boot: {unit.name}: skipped (not a command the sim host runs): {command}")
            continue
        ran_any = True
        proc = subprocess.run(argv, env=unit_env(root, unit), capture_output=True, text=True)
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        why = f" ({said[-1]})" if proc.returncode != 0 and said else ""  # as the journal keeps it
        log(root, f"boot: {unit.name}: {command} -> exit {proc.returncode}{why}")
        if proc.returncode != 0 and not command.startswith("-"):
            break
    return ran_any


def _sim_argv(root: Path, argv: list[str]) -> list[str] | None:
    program = os.path.basename(argv[0])
    if program in HOST_TOOLS:
        bin_dir, _ = HOST_TOOLS[program]
        return [str(root / bin_dir / program), *argv[1:]]
    if program == "ddops":
        installed = root / argv[0].lstrip("/")  # the host's own ddops, as a real host runs it
        if not (argv[0].startswith("/") and os.access(installed, os.X_OK)):
            return None
        args = [_on_host(root, arg) for arg in _without_host_option(argv[1:])]
        return [str(installed), "--host", f"sim:{root}", *args]
    return None


def _on_host(root: Path, arg: str) -> str:
    """An absolute path that exists on the simulated host (e.g. -i /etc/ddops/site.yml), below
    its root; anything else as it is."""
    return (
        str(root / arg.lstrip("/"))
        if arg.startswith("/") and (root / arg.lstrip("/")).exists()
        else arg
    )


def _without_host_option(args: list[str]) -> list[str]:
    """args less any `--host X` / `--host=X`: on the sim host, the host is the sim."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--host":
            skip = True
        elif not arg.startswith("--host="):
            kept.append(arg)
    return kept


def unit_env(root: Path, unit: Path) -> dict[str, str]:
    """The environment a unit's commands get: the sim host's tools first on PATH, and the unit's
    EnvironmentFile= files read as systemd reads them (below the sim root; "-" optional)."""
    from ops.agents.supervise import env_file_path, read_env_file

    env = dict(os.environ)
    env["PATH"] = f"{root / 'usr/sbin'}:{root / 'usr/bin'}:{env.get('PATH', '')}"
    for line in unit.read_text().splitlines():
        if line.strip().startswith("EnvironmentFile="):
            try:  # read raw, as systemd reads it; a path it would ignore is ignored here too
                path = env_file_path(line.strip().removeprefix("EnvironmentFile="))
            except ValueError as exc:
                log(root, f"boot: {unit.name}: {exc}: ignored")
                continue
            optional = "-" if path.startswith("-") else ""
            env.update(read_env_file(optional + str(root / path.lstrip("-").lstrip("/"))))
    return env
