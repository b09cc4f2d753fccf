"""The site description: an Ansible-style YAML inventory read by the CLI and the playbooks alike.

    all:
      vars:
        ddops_model:
          target: {repo: Qwen/Qwen3.6-27B, revision: main}
          draft: {repo: z-lab/Qwen3.6-27B-DFlash, revision: main}
          hub_endpoint: https://huggingface.co        # optional; HF_TOKEN comes from the environment
        ddops_engine: {method: ddtree, budget: 15, port: 8000, max_model_len: 32768, tp: 1}
      hosts:
        pve1:
          ansible_host: 192.0.2.10                     # ssh as root (devN and hookscript need root@pam)
          ddops_containers:
            - {vmid: 200, hostname: llm, cores: 16, memory_mib: 131072, gpus: [0], shm_gib: 64}

A host is reached by `ddops_target` when given (`local`, `sim:PATH`, `ssh://...`), else over SSH
to ansible_host / ansible_user / ansible_port. Every value that can reach a command is validated
here, so later code can trust it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from ops.errors import DdopsError
from ops.pve import validate_vmid

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
METHODS = ("ar", "linear", "ddtree")
DEFAULT_ENGINE_PYTHON = "/opt/ddops/venv/bin/python"


def validate_repo_id(repo: str) -> str:
    if not isinstance(repo, str) or not REPO_ID.match(repo) or ".." in repo:
        raise DdopsError(f"repo {repo!r}", "not a Hugging Face repo id like org/name")
    return repo


@dataclass(frozen=True)
class ModelRef:
    """One hub repo at a revision, staged as /dev/shm/models/<name>."""

    repo: str
    revision: str = "main"
    name: str = ""

    def __post_init__(self) -> None:
        validate_repo_id(self.repo)
        if not REVISION.match(self.revision) or ".." in self.revision:
            raise DdopsError(f"revision {self.revision!r}", "not a branch, tag or commit id")
        if not self.name:
            object.__setattr__(self, "name", self.repo.split("/")[1].lower())
        if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", self.name):
            raise DdopsError(
                f"model name {self.name!r}", "use lowercase letters, digits, '.', '_', '-'"
            )


@dataclass(frozen=True)
class ModelSpec:
    target: ModelRef
    draft: ModelRef | None = None
    hub_endpoint: str | None = None


@dataclass(frozen=True)
class EngineSpec:
    method: str = "ddtree"
    budget: int = 15
    port: int = 8000
    max_model_len: int = 32768
    tp: int = 1
    dtype: str = "auto"
    device: str = "auto"
    python: str = DEFAULT_ENGINE_PYTHON  # the engine's interpreter inside the CT

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise DdopsError(
                f"engine method {self.method!r}", f"choose one of {', '.join(METHODS)}"
            )
        checks = {
            "budget": 1 <= self.budget <= 1024,
            "port": 1 <= self.port <= 65535,
            "max_model_len": self.max_model_len >= 16,
            "tp": self.tp in (1, 2, 4, 8),
        }
        for name, ok in checks.items():
            if not ok:
                raise DdopsError(f"engine {name} {getattr(self, name)!r}", "out of range")
        if not self.python.startswith("/"):
            raise DdopsError(f"engine python {self.python!r}", "must be an absolute path")


@dataclass(frozen=True)
class ContainerSpec:
    vmid: int
    hostname: str = "ddops-llm"
    cores: int = 4
    memory_mib: int = 8192
    swap_mib: int = 0
    gpus: tuple[int, ...] = (0,)
    shm_gib: int = 4
    onboot: bool = True
    ostemplate: str = "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"
    rootfs: str = "local-lvm:32"
    net0: str = "name=eth0,bridge=vmbr0,ip=dhcp"
    device_style: str = "auto"  # auto (devN on PVE >= 8.1) | devN | raw

    def __post_init__(self) -> None:
        object.__setattr__(self, "vmid", int(validate_vmid(self.vmid)))
        object.__setattr__(self, "gpus", tuple(int(g) for g in self.gpus))
        if not HOSTNAME.match(self.hostname):
            raise DdopsError(
                f"CT {self.vmid}", f"hostname {self.hostname!r} is not a valid hostname"
            )
        if self.device_style not in ("auto", "devN", "raw"):
            raise DdopsError(f"CT {self.vmid}", "device_style must be auto, devN or raw")
        if self.memory_mib < 256 or self.cores < 1 or self.shm_gib < 1:
            raise DdopsError(f"CT {self.vmid}", "cores, memory_mib and shm_gib must be positive")


@dataclass(frozen=True)
class HostSpec:
    name: str
    target: str  # local | sim:PATH | ssh://[user@]host[:port]
    containers: tuple[ContainerSpec, ...] = ()


@dataclass(frozen=True)
class Site:
    hosts: tuple[HostSpec, ...]
    model: ModelSpec
    engine: EngineSpec = field(default_factory=EngineSpec)

    def find_container(self, vmid: int) -> tuple[HostSpec, ContainerSpec]:
        vmid = int(validate_vmid(vmid))
        for host in self.hosts:
            for ct in host.containers:
                if ct.vmid == vmid:
                    return host, ct
        raise DdopsError(f"CT {vmid}", "not in the inventory")


def _build(cls: type, data: Any, where: str):
    if not isinstance(data, dict):
        raise DdopsError(where, f"expected a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise DdopsError(
            where, f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    try:
        return cls(**data)
    except TypeError as exc:
        raise DdopsError(where, str(exc)) from exc


def _host_target(name: str, hostvars: dict) -> str:
    if "ddops_target" in hostvars:
        return str(hostvars["ddops_target"])
    address = hostvars.get("ansible_host", name)
    user = hostvars.get("ansible_user", "root")
    port = hostvars.get("ansible_port", 22)
    return f"ssh://{user}@{address}:{port}"


def parse_site(data: Any, source: str = "inventory") -> Site:
    """Build a Site from a loaded inventory document (the `all:` group form)."""
    group = (data or {}).get("all") if isinstance(data, dict) else None
    if not isinstance(group, dict):
        raise DdopsError(source, "expected a top-level 'all:' group")
    gvars = group.get("vars") or {}
    model_data = gvars.get("ddops_model")
    if not isinstance(model_data, dict) or "target" not in model_data:
        raise DdopsError(source, "all.vars.ddops_model.target is required")
    model = ModelSpec(
        target=_build(ModelRef, model_data["target"], f"{source}: ddops_model.target"),
        draft=_build(ModelRef, model_data["draft"], f"{source}: ddops_model.draft")
        if model_data.get("draft")
        else None,
        hub_endpoint=model_data.get("hub_endpoint"),
    )
    engine = _build(EngineSpec, gvars.get("ddops_engine") or {}, f"{source}: ddops_engine")
    hosts = []
    for name, hostvars in (group.get("hosts") or {}).items():
        hostvars = hostvars or {}
        cts = tuple(
            _build(ContainerSpec, ct, f"{source}: host {name} container #{i}")
            for i, ct in enumerate(hostvars.get("ddops_containers") or [])
        )
        for ct in cts:
            if engine.tp > len(ct.gpus):
                raise DdopsError(
                    f"CT {ct.vmid}",
                    f"engine tp {engine.tp} needs {engine.tp} GPUs, the CT has {len(ct.gpus)}",
                )
        hosts.append(HostSpec(name, _host_target(name, hostvars), cts))
    if not hosts:
        raise DdopsError(source, "no hosts under all.hosts")
    return Site(tuple(hosts), model, engine)


def load_site(path: str | Path) -> Site:
    """Read and validate an inventory file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise DdopsError(str(path), "inventory file not found") from exc
    except yaml.YAMLError as exc:
        raise DdopsError(str(path), f"not valid YAML: {exc}") from exc
    return parse_site(data, str(path))
