"""ddops on the Proxmox host itself, so that recovery at boot needs nobody: the operator's ddops
version at /usr/local/bin/ddops, and the host's own site file at /etc/ddops/site.yml (that host's
part of the inventory, `ddops_target: local`, no secrets). The boot units run exactly that.

    host_problems(t, site_text)       # what is missing or stale, in words ([] when all is in step)
    install_host_ddops(t, dry_run)    # the same ddops version on the host (Outcome)
    host_site_text(t, host, model, engine)  # the site file this host should have

Over SSH (the usual set-up: ddops on a laptop), the host gets a venv at /opt/ddops/venv with a
wheel of this ddops copied over SFTP and its dependencies from the host's package index (no
engine extra: torch stays in the CTs), and /usr/local/bin/ddops links to it. When ddops runs on
the host itself (a local or simulated host), /usr/local/bin/ddops is a two-line wrapper around
this very install. Paths go through the transport, so a simulated host keeps it all below its
root.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import PurePosixPath

import yaml

from ops.errors import DdopsError
from ops.host.transport import LocalTransport, Transport
from ops.host.wheel import built_wheel, ddops_version
from ops.site.inventory import EngineSpec, HostSpec, ModelSpec, Site, site_document

HOST_DDOPS = "/usr/local/bin/ddops"
HOST_SITE = "/etc/ddops/site.yml"
HOST_VENV = "/opt/ddops/venv"
HF_TOKEN_FILE = "/etc/ddops/hf-token.env"  # nosec B105 - a path; only with `provision --store-hf-token` (root, 0600)
WHEEL_DIR = "/var/lib/ddops/wheels"
PIP_TIMEOUT_S = 1800.0
SITE_HEADER = (
    "# Written by `ddops provision`: this host's part of the site, for the boot-time recovery\n"
    "# (ddops-recover.service). No secrets: the engine's API key stays in each CT.\n"
)


def local_target(t: Transport) -> str:
    """How ddops on the host names the host itself: `local`, or `sim:ROOT` for a simulated one."""
    return f"sim:{t.sysroot}" if t.sysroot else "local"


def host_site_text(t: Transport, host: HostSpec, model: ModelSpec, engine: EngineSpec) -> str:
    """The host's own site file: its containers, the site's model and engine, no secrets."""
    here = HostSpec(host.name, local_target(t), tuple(host.containers))
    document = site_document(Site((here,), model, engine))
    return SITE_HEADER + yaml.safe_dump(document, sort_keys=False)


def installed_version(t: Transport) -> str | None:
    """The version `ddops --version` on the host reports; None when it does not run."""
    r = t.run([t.host_path(HOST_DDOPS), "--version"], timeout=60)
    words = r.stdout.split()
    return words[-1] if r.ok and words else None


def host_problems(t: Transport, site_text: str) -> list[str]:
    """What keeps the host from recovering on its own: no or another ddops, a stale site file."""
    problems = []
    version, wanted = installed_version(t), ddops_version()
    if version is None:
        problems.append(f"{HOST_DDOPS} does not run on the host")
    elif version != wanted:
        problems.append(f"{HOST_DDOPS} is ddops {version}, this is ddops {wanted}")
    if not t.exists(HOST_SITE):
        problems.append(f"{HOST_SITE} is missing")
    elif t.read_text(HOST_SITE) != site_text:
        problems.append(f"{HOST_SITE} differs from the inventory's part for this host")
    return problems


def hf_token_problem(t: Transport, token: str) -> str | None:
    """Whether the stored token is this one (compared on the host side, never printed)."""
    if t.exists(HF_TOKEN_FILE) and t.read_text(HF_TOKEN_FILE) == _token_text(token):
        return None
    return f"{HF_TOKEN_FILE} does not hold this HF_TOKEN"


def store_hf_token(t: Transport, token: str, dry_run: bool) -> str | None:
    """HF_TOKEN for the boot-time recovery (a gated model re-downloaded when the CT's cache is
    damaged): root-only, written atomically; what was done, or None."""
    if hf_token_problem(t, token) is None:
        return None
    if dry_run:
        return f"would store HF_TOKEN in {HF_TOKEN_FILE} (0600)"
    t.write_file(HF_TOKEN_FILE, _token_text(token), mode=0o600, backup=False)
    return f"stored HF_TOKEN in {HF_TOKEN_FILE} (0600)"


def _token_text(token: str) -> str:
    return f"HF_TOKEN={token}\n"


def write_host_site(t: Transport, site_text: str, dry_run: bool) -> str | None:
    """The site file in step (backed up, written atomically); what was done, or None."""
    if t.exists(HOST_SITE) and t.read_text(HOST_SITE) == site_text:
        return None
    if dry_run:
        return f"would write {HOST_SITE}"
    backup = t.write_file(HOST_SITE, site_text, mode=0o644)
    return f"wrote {HOST_SITE}" + (f" (backup {backup})" if backup else "")


def install_host_ddops(t: Transport, dry_run: bool) -> str | None:
    """The operator's ddops version runnable as /usr/local/bin/ddops; what was done, or None."""
    if installed_version(t) == ddops_version():
        return None
    if isinstance(t, LocalTransport):
        if dry_run:
            return f"would write {HOST_DDOPS} (this ddops, {sys.executable})"
        t.write_file(HOST_DDOPS, _wrapper(), mode=0o755, backup=False)
        return f"wrote {HOST_DDOPS}: ddops {ddops_version()} of {sys.executable}"
    if dry_run:
        return f"would install ddops {ddops_version()} into {HOST_VENV} and link {HOST_DDOPS}"
    return _install_venv(t)


def _wrapper() -> str:
    return (
        "#!/bin/sh\n# Written by `ddops provision`: the ddops that runs on this host.\n"
        f'exec {shlex.quote(sys.executable)} -m ops.cli "$@"\n'
    )


def _install_venv(t: Transport) -> str:
    """A venv on the host with this ddops (a wheel over SFTP, else ddops==VERSION from the index)."""
    venv = t.host_path(HOST_VENV)
    with built_wheel() as wheel:
        requirement = f"ddops=={ddops_version()}"
        if wheel is not None:
            dest = f"{WHEEL_DIR}/{wheel.name}"
            t.write_file(dest, wheel.read_bytes(), mode=0o644, backup=False)
            requirement = t.host_path(dest)
    steps = [
        (["python3", "-m", "venv", venv], "creating the ddops venv", 300.0),
        ([f"{venv}/bin/pip", "install", "--upgrade", requirement], "pip install ddops", None),
        (["mkdir", "-p", str(PurePosixPath(t.host_path(HOST_DDOPS)).parent)], "mkdir", 60.0),
        (["ln", "-sfn", f"{venv}/bin/ddops", t.host_path(HOST_DDOPS)], "linking ddops", 60.0),
    ]
    for argv, what, timeout in steps:
        r = t.run(argv, timeout=timeout or PIP_TIMEOUT_S)
        if not r.ok:
            last = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or [f"exit {r.rc}"]
            raise DdopsError(t.label, f"{what} failed: {last[0]}")
    if (version := installed_version(t)) != ddops_version():
        raise DdopsError(t.label, f"installed ddops, but {HOST_DDOPS} reports {version}")
    return f"installed ddops {ddops_version()} into {HOST_VENV}, linked {HOST_DDOPS}"
