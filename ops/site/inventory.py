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

import dataclasses
import ipaddress
import json
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from engine.memory_plan import MAX_NUM_SEQS
from engine.methods import METHODS
from ops.errors import DdopsError, InputError
from ops.host.pve import VMID_RANGE, VMID_RULE, validate_vmid
from ops.host.targets import parse_target_syntax, valid_hostname

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
MODEL_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
# Proxmox volume ids: `storage:vztmpl/<file>.tar[.gz|.xz|.zst|.bz2]` and `storage:<size in GiB>`
OSTEMPLATE = re.compile(r"[A-Za-z][A-Za-z0-9._-]*:vztmpl/[A-Za-z0-9._+-]+\.tar(\.(gz|xz|zst|bz2))?")
ROOTFS = re.compile(r"[A-Za-z][A-Za-z0-9._-]*:[1-9][0-9]{0,5}")
# net0: comma-separated key=value properties of `pct create --net0`, keys as Proxmox names them
NET_KEYS = ("name", "bridge", "ip", "ip6", "gw", "gw6", "hwaddr", "firewall", "tag", "mtu", "rate")
NET_PROPERTY = re.compile(rf"(?:{'|'.join(NET_KEYS)})=[A-Za-z0-9._:/-]+")
ENGINE_PYTHON = re.compile(r"(/[A-Za-z0-9._+-]+)+")
USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
DTYPES = ("auto", "float32", "bfloat16", "float64")
DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]{1,2})?")
DEFAULT_ENGINE_PYTHON = "/opt/ddops/venv/bin/python"
MAX_MIB = 1 << 24  # 16 TiB: above any host Proxmox runs on
LOOPBACK_HOSTS = ("localhost",)


# -- field checks: each returns the value or raises InputError naming the field ------------------
def _bad(obj: str, name: str, value: Any, cause: str) -> InputError:
    return InputError(obj, f"{name} {value!r}: {cause}")


def check_int(obj: str, name: str, value: Any, lo: int, hi: int) -> int:
    """An int (not a bool, not a float) in lo..hi."""
    if type(value) is not int:
        raise _bad(obj, name, value, f"must be an integer from {lo} to {hi}")
    if not lo <= value <= hi:
        raise _bad(obj, name, value, f"out of range {lo}..{hi}")
    return value


def check_bool(obj: str, name: str, value: Any) -> bool:
    if type(value) is not bool:
        raise _bad(obj, name, value, "must be true or false")
    return value


def check_str(obj: str, name: str, value: Any, pattern: re.Pattern, cause: str) -> str:
    """A string that fully matches `pattern` (no trailing newline slips through `$`)."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise _bad(obj, name, value, cause)
    return value


def check_choice(obj: str, name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise _bad(obj, name, value, f"choose one of {', '.join(choices)}")
    return value


def validate_repo_id(repo: str) -> str:
    if not isinstance(repo, str) or not REPO_ID.fullmatch(repo) or ".." in repo:
        raise InputError(f"repo {repo!r}", "not a Hugging Face repo id like org/name")
    return repo


def validate_hub_endpoint(url: Any, sends_token: bool) -> str:
    """An http(s) URL of a hub (scheme, host, optional port and path; no user, query or
    fragment); https when a token would be sent to a host that is not this machine. A
    password in the URL is never repeated in the message."""
    obj = "ddops_model.hub_endpoint"
    shown = re.sub(r"//[^/]*@", "//***@", url) if isinstance(url, str) else url
    like = f"{shown!r} is not an http(s) URL like https://huggingface.co"
    if not isinstance(url, str) or not re.fullmatch(r"https?://[A-Za-z0-9._:\[\]/-]+", url):
        raise InputError(obj, like)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise InputError(obj, f"{shown!r}: {exc}") from exc
    if not parts.hostname:
        raise InputError(obj, like)
    if sends_token and parts.scheme == "http" and not _is_loopback(parts.hostname):
        raise InputError(obj, f"{url!r}: HF_TOKEN would cross the network unencrypted; use https")
    return url


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ModelRef:
    """One hub repo at a revision, staged as /dev/shm/models/<name>."""

    repo: str
    revision: str = "main"
    name: str = ""

    def __post_init__(self) -> None:
        validate_repo_id(self.repo)
        obj = f"model {self.repo}"
        check_str(obj, "revision", self.revision, REVISION, "not a branch, tag or commit id")
        if ".." in self.revision:
            raise _bad(obj, "revision", self.revision, "not a branch, tag or commit id")
        if not self.name:
            object.__setattr__(self, "name", self.repo.split("/")[1].lower())
        check_str(
            obj,
            "model name",
            self.name,
            MODEL_NAME,
            "must be lowercase letters, digits, '.', '_', '-'",
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
    max_num_seqs: int | None = None  # sequences at once; None: the engine's (fit, up to 4)
    kv_cache_tokens: int | None = None  # a KV pool the sequences share; None: a context each
    tp: int = 1
    dtype: str = "auto"
    device: str = "auto"
    python: str = DEFAULT_ENGINE_PYTHON  # the engine's interpreter inside the CT

    def __post_init__(self) -> None:
        obj = "ddops_engine"
        check_choice(obj, "method", self.method, METHODS)
        check_int(obj, "budget", self.budget, 1, 1024)
        check_int(obj, "port", self.port, 1, 65535)
        check_int(obj, "max_model_len", self.max_model_len, 16, 1 << 24)
        if self.max_num_seqs is not None:
            check_int(obj, "max_num_seqs", self.max_num_seqs, 1, MAX_NUM_SEQS)
        if self.kv_cache_tokens is not None:
            check_int(obj, "kv_cache_tokens", self.kv_cache_tokens, 16, 1 << 30)
        check_int(obj, "tp", self.tp, 1, 8)
        if self.tp not in (1, 2, 4, 8):
            raise _bad(obj, "tp", self.tp, "choose one of 1, 2, 4, 8")
        check_choice(obj, "dtype", self.dtype, DTYPES)
        check_str(obj, "device", self.device, DEVICE, "must be auto, cpu, cuda or cuda:N")
        check_str(obj, "python", self.python, ENGINE_PYTHON, "must be an absolute path, one word")
        if any(part in (".", "..") for part in self.python.split("/")):
            raise _bad(obj, "python", self.python, "must be an absolute path without '.' or '..'")


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
    privileged: bool = False  # a new CT is unprivileged unless the inventory asks
    gpu_gid: int = 44  # the GPU nodes' group in the CT (Debian's video): the engine's group

    def __post_init__(self) -> None:
        if type(self.vmid) is not int or self.vmid not in VMID_RANGE:
            raise InputError(f"CT {self.vmid!r}", VMID_RULE)
        obj = f"CT {self.vmid}"
        if not isinstance(self.gpus, list | tuple):
            raise _bad(obj, "gpus", self.gpus, "must be a list of GPU indices")
        gpus = tuple(check_int(obj, "gpu", g, 0, 255) for g in self.gpus)
        if len(set(gpus)) != len(gpus):
            raise _bad(obj, "gpus", list(gpus), "a GPU is listed twice")
        object.__setattr__(self, "gpus", gpus)
        check_str(obj, "hostname", self.hostname, HOSTNAME, "not a valid hostname")
        check_int(obj, "cores", self.cores, 1, 8192)
        check_int(obj, "memory_mib", self.memory_mib, 256, MAX_MIB)
        check_int(obj, "swap_mib", self.swap_mib, 0, MAX_MIB)
        check_int(obj, "shm_gib", self.shm_gib, 1, MAX_MIB >> 10)
        check_bool(obj, "onboot", self.onboot)
        check_str(
            obj,
            "ostemplate",
            self.ostemplate,
            OSTEMPLATE,
            "must be a template volume STORAGE:vztmpl/FILE.tar.*",
        )
        check_str(obj, "rootfs", self.rootfs, ROOTFS, "must be STORAGE:SIZE_GIB, e.g. local-lvm:32")
        properties = self.net0.split(",") if isinstance(self.net0, str) else [None]
        if not all(isinstance(p, str) and NET_PROPERTY.fullmatch(p) for p in properties):
            raise _bad(
                obj, "net0", self.net0, f"must be KEY=VALUE,... with keys {', '.join(NET_KEYS)}"
            )
        check_choice(obj, "device_style", self.device_style, ("auto", "devN", "raw"))
        check_bool(obj, "privileged", self.privileged)
        check_int(obj, "gpu_gid", self.gpu_gid, 1, 65535)


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
        raise InputError(f"CT {vmid}", "not in the inventory")


def _build(cls: type, data: Any, where: str):
    """cls(**data), every problem an InputError prefixed with `where`."""
    if not isinstance(data, dict):
        raise InputError(where, f"expected a mapping, got {type(data).__name__}")
    _no_unknown_keys(data, {f.name for f in fields(cls)}, where)
    required = [
        f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
    ]
    if missing := [name for name in required if name not in data]:
        raise InputError(where, f"{', '.join(missing)} is required")
    try:
        return cls(**data)
    except DdopsError as exc:
        raise InputError(where, str(exc)) from exc


def _no_unknown_keys(data: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise InputError(
            where, f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )


def _mapping(value: Any, where: str) -> dict:
    """A mapping with string keys; None (an empty YAML section) is an empty one."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(where, f"expected a mapping, got {type(value).__name__}")
    if bad := [k for k in value if not isinstance(k, str)]:
        raise InputError(where, f"keys must be strings, got {bad[0]!r}")
    return value


def _host_target(name: str, hostvars: dict, where: str) -> str:
    if "ddops_target" in hostvars:
        target = hostvars["ddops_target"]
        if not isinstance(target, str):
            raise _bad(where, "ddops_target", target, "must be a string")
        try:
            return parse_target_syntax(target)
        except DdopsError as exc:
            raise InputError(where, str(exc)) from exc
    address = hostvars.get("ansible_host", name)
    if not isinstance(address, str) or not valid_hostname(address):
        raise _bad(where, "ansible_host", address, "must be a host name or an IP address")
    user = check_str(
        where, "ansible_user", hostvars.get("ansible_user", "root"), USER, "must be a user name"
    )
    port = check_int(where, "ansible_port", hostvars.get("ansible_port", 22), 1, 65535)
    bracketed = f"[{address}]" if ":" in address else address
    return f"ssh://{user}@{bracketed}:{port}"


def _model_spec(gvars: dict, source: str, sends_token: bool) -> ModelSpec:
    where = f"{source}: ddops_model"
    model_data = _mapping(gvars.get("ddops_model"), where)
    if "target" not in model_data:
        raise InputError(source, "all.vars.ddops_model.target is required")
    _no_unknown_keys(model_data, {"target", "draft", "hub_endpoint"}, where)
    endpoint = model_data.get("hub_endpoint")
    try:
        endpoint = validate_hub_endpoint(endpoint, sends_token) if endpoint is not None else None
    except InputError as exc:
        raise InputError(source, str(exc)) from exc
    return ModelSpec(
        target=_build(ModelRef, model_data["target"], f"{where}.target"),
        draft=_build(ModelRef, model_data["draft"], f"{where}.draft")
        if model_data.get("draft") is not None
        else None,
        hub_endpoint=endpoint,
    )


def _containers(value: Any, where: str) -> tuple[ContainerSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InputError(where, f"ddops_containers must be a list, got {type(value).__name__}")
    cts = tuple(_build(ContainerSpec, ct, f"{where} container #{i}") for i, ct in enumerate(value))
    vmids = [ct.vmid for ct in cts]
    if len(set(vmids)) != len(vmids):
        raise InputError(where, f"a vmid is listed twice: {vmids}")
    return cts


def parse_site(data: Any, source: str = "inventory", *, sends_token: bool | None = None) -> Site:
    """Build a Site from a loaded inventory document (the `all:` group form); every value is
    checked here (InputError). sends_token: whether an HF token goes to the hub (default:
    HF_TOKEN is set), which then must be https unless it is on this machine."""
    if sends_token is None:
        sends_token = bool(os.environ.get("HF_TOKEN"))
    group = _mapping(data, source).get("all")
    if not isinstance(group, dict):
        raise InputError(source, "expected a top-level 'all:' group")
    group = _mapping(group, f"{source}: all")
    gvars = _mapping(group.get("vars"), f"{source}: all.vars")
    model = _model_spec(gvars, source, sends_token)
    engine_where = f"{source}: ddops_engine"
    engine_data = _mapping(gvars.get("ddops_engine"), engine_where)
    _no_unknown_keys(engine_data, {f.name for f in fields(EngineSpec)}, engine_where)
    engine = _build(EngineSpec, engine_data, source)  # its own errors name ddops_engine
    hosts = []
    for name, hostvars in _mapping(group.get("hosts"), f"{source}: all.hosts").items():
        where = f"{source}: host {name}"
        hostvars = _mapping(hostvars, where)
        cts = _containers(hostvars.get("ddops_containers"), where)
        for ct in cts:
            if engine.tp > len(ct.gpus):
                raise InputError(
                    f"{where}: CT {ct.vmid}",
                    f"engine tp {engine.tp} needs {engine.tp} GPUs, the CT has {len(ct.gpus)}",
                )
        hosts.append(HostSpec(name, _host_target(name, hostvars, where), cts))
    if not hosts:
        raise InputError(source, "no hosts under all.hosts")
    return Site(tuple(hosts), model, engine)


def load_site(path: str | Path) -> Site:
    """Read and validate an inventory file (InputError for anything wrong with it)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except FileNotFoundError as exc:
        raise InputError(str(path), "inventory file not found") from exc
    except OSError as exc:
        raise InputError(str(path), f"cannot read the inventory: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(str(path), f"not UTF-8 text (byte {exc.start})") from exc
    except yaml.YAMLError as exc:
        first = " ".join(str(exc).split())
        raise InputError(str(path), f"not valid YAML: {first}") from exc
    return parse_site(data, str(path))


def site_document(site: Site) -> dict:
    """The inventory document that `parse_site` reads back as `site` (tuples become lists)."""

    def plain(value) -> object:
        return json.loads(json.dumps(dataclasses.asdict(value)))

    hosts = {
        host.name: {
            "ddops_target": host.target,
            "ddops_containers": [plain(ct) for ct in host.containers],
        }
        for host in site.hosts
    }
    model = {k: v for k, v in plain(site.model).items() if v is not None}
    return {
        "all": {"vars": {"ddops_model": model, "ddops_engine": plain(site.engine)}, "hosts": hosts}
    }
