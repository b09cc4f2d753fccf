"""The one Jinja2 environment over templates/, and the validated specs the CLI renders from.

The playbooks render the same template files through Ansible's `template` module, so this
environment copies that module's settings (trim_blocks on, lstrip_blocks off, the template's
trailing newline kept, undefined variables an error) and every template takes all of its
variables explicitly: the same variables give byte-identical files on both paths.

    from ops.render import EngineUnit, render
    unit = EngineUnit(python="/opt/ddops/bin/python", model="/dev/shm/models/target", ...)
    text = render(unit)                 # validated first: DdopsError names the bad value
    unit.INSTALL_PATH                   # where the file goes ("/etc/systemd/system/...")

Each spec's docstring and its template's header comment list the variables; the names in
`variables()` are the ones a playbook passes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from functools import cache
from typing import Any, ClassVar, NoReturn

import jinja2

from engine.memory_plan import MAX_NUM_SEQS
from engine.methods import METHODS
from ops.errors import DdopsError
from ops.resources import templates_dir

MODULE_NAME = re.compile(r"[A-Za-z0-9_-]+")
USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
CUDA_DEVICE_LIST = re.compile(r"\d+(,\d+)*")
HOST_NAME = re.compile(r"[A-Za-z0-9_.:\[\]-]+")
DEVICE_NAME = re.compile(r"cpu|cuda(:\d+)?")
DTYPES = ("float32", "bfloat16", "float64")  # what `python -m engine serve --dtype` takes
VMID_RANGE = range(100, 1_000_000_000)  # what Proxmox VE accepts as a guest id


@cache
def environment() -> jinja2.Environment:
    """The Jinja2 environment over templates/, with Ansible's `template` module settings."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=False,
        keep_trailing_newline=True,
        autoescape=False,  # nosec B701 - systemd units and CT configs: HTML escaping corrupts them
    )


def render_template(name: str, variables: Mapping[str, Any]) -> str:
    """Render templates/<name> with exactly these variables (a missing one is an error)."""
    try:
        return environment().get_template(name).render(**variables)
    except jinja2.UndefinedError as exc:
        raise DdopsError(f"template {name}", f"missing variable: {exc.message}") from exc


class TemplateSpec:
    """Base of the specs below: a dataclass whose fields are exactly its template's variables."""

    TEMPLATE: ClassVar[str]
    INSTALL_PATH: ClassVar[str]  # where the rendered file is installed
    MODE: ClassVar[int] = 0o644  # its permission bits there

    def variables(self) -> dict[str, Any]:
        """The template's variables: every field, tuples as lists (as YAML would give them)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
        return {name: list(v) if isinstance(v, tuple) else v for name, v in values.items()}


def render(spec: TemplateSpec) -> str:
    """Render a validated spec through its template."""
    return render_template(spec.TEMPLATE, spec.variables())


# -- validation helpers: each raises DdopsError naming the template and the bad value ---------


def _fail(template: str, cause: str) -> NoReturn:
    raise DdopsError(f"template {template}", cause)


def _check_path(template: str, name: str, value: str | None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value.startswith("/"):
        _fail(template, f"{name} must be an absolute path, got {value!r}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        _fail(template, f"{name} must not contain control characters: {value!r}")


def _check_raw_path(template: str, name: str, value: str | None, optional: bool = False) -> None:
    """A path a unit names where systemd reads it raw (EnvironmentFile=): absolute, and no
    blank, quote, backslash, specifier or variable that systemd would take as part of it."""
    _check_path(template, name, value, optional)
    if value is not None and any(c.isspace() or c in "\"'\\%$" for c in value):
        _fail(template, f"{name} must be a plain path (no blank, quote, \\, % or $): {value!r}")


def _check_int(template: str, name: str, value: int, allowed: range) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
        _fail(
            template,
            f"{name} must be an integer in {allowed.start}..{allowed.stop - 1}, got {value!r}",
        )


def _check_match(template: str, name: str, value: str | None, pattern: re.Pattern[str]) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        _fail(template, f"{name} {value!r} is not of the form {pattern.pattern}")


def _check_choice(template: str, name: str, value: str | None, choices: Sequence[str]) -> None:
    if value not in choices:
        _fail(template, f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _check_minors(template: str, minors: Sequence[int]) -> None:
    if not minors:
        _fail(template, "gpu_minors must name at least one GPU")
    for minor in minors:
        _check_int(template, "gpu minor", minor, range(0, 255))


def _check_vmid(template: str, vmid: int) -> None:
    _check_int(template, "vmid", vmid, VMID_RANGE)


# -- the specs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NvidiaModules(TemplateSpec):
    """/etc/modules-load.d file: the NVIDIA kernel modules to load at boot."""

    TEMPLATE: ClassVar[str] = "nvidia-modules.conf.j2"
    INSTALL_PATH: ClassVar[str] = "/etc/modules-load.d/ddops-nvidia.conf"

    modules: tuple[str, ...] = ("nvidia", "nvidia_uvm")

    def __post_init__(self) -> None:
        if not self.modules:
            _fail(self.TEMPLATE, "modules must name at least one kernel module")
        for module in self.modules:
            _check_match(self.TEMPLATE, "module", module, MODULE_NAME)


@dataclass(frozen=True)
class GpuNodesUnit(TemplateSpec):
    """The boot unit that creates /dev/nvidia* and /dev/nvidia-uvm before pve-guests.service."""

    TEMPLATE: ClassVar[str] = "ddops-gpu-nodes.service.j2"
    INSTALL_PATH: ClassVar[str] = "/etc/systemd/system/ddops-gpu-nodes.service"

    nvidia_modprobe: str = "/usr/bin/nvidia-modprobe"
    gpu_minors: tuple[int, ...] = (0,)
    modeset: bool = True

    def __post_init__(self) -> None:
        _check_path(self.TEMPLATE, "nvidia_modprobe", self.nvidia_modprobe)
        _check_minors(self.TEMPLATE, self.gpu_minors)


@dataclass(frozen=True)
class RecoverUnit(TemplateSpec):
    """The boot unit that runs `ddops recover --ct VMID --at-boot` for each GPU CT after pve-guests.service."""

    TEMPLATE: ClassVar[str] = "ddops-recover.service.j2"
    INSTALL_PATH: ClassVar[str] = "/etc/systemd/system/ddops-recover.service"

    vmids: tuple[int, ...]
    ddops: str = "/usr/local/bin/ddops"
    inventory: str | None = None
    timeout_s: int = 1800
    env_file: str | None = None

    def __post_init__(self) -> None:
        if not self.vmids:
            _fail(self.TEMPLATE, "vmids must name at least one container")
        for vmid in self.vmids:
            _check_vmid(self.TEMPLATE, vmid)
        _check_path(self.TEMPLATE, "ddops", self.ddops)
        _check_path(self.TEMPLATE, "inventory", self.inventory, optional=True)
        _check_int(self.TEMPLATE, "timeout_s", self.timeout_s, range(1, 86_401))
        _check_raw_path(self.TEMPLATE, "env_file", self.env_file, optional=True)


@dataclass(frozen=True)
class KernelHook(TemplateSpec):
    """/etc/kernel/postinst.d/zz-ddops-nvidia: a kernel whose NVIDIA build failed never boots
    next; the running one is pinned until it has the module (templates/ddops-kernel-hook.sh.j2)."""

    TEMPLATE: ClassVar[str] = "ddops-kernel-hook.sh.j2"
    INSTALL_PATH: ClassVar[str] = "/etc/kernel/postinst.d/zz-ddops-nvidia"
    MODE: ClassVar[int] = 0o755

    record: str  # ops/host/kernels.py PIN_RECORD, where the machine running the hook has it

    def __post_init__(self) -> None:
        _check_path(self.TEMPLATE, "record", self.record)


@dataclass(frozen=True)
class Hookscript(TemplateSpec):
    """The Proxmox hookscript: pre-start creates the device nodes, post-start starts recovery."""

    TEMPLATE: ClassVar[str] = "ddops-hook.sh.j2"
    INSTALL_PATH: ClassVar[str] = "/var/lib/vz/snippets/ddops-hook.sh"
    PVE_VOLUME: ClassVar[str] = "local:snippets/ddops-hook.sh"  # the CT's `hookscript:` value

    nvidia_modprobe: str = "/usr/bin/nvidia-modprobe"
    gpu_minors: tuple[int, ...] = (0,)
    modeset: bool = True
    systemd_run: str = "/usr/bin/systemd-run"
    ddops: str = "/usr/local/bin/ddops"
    inventory: str | None = None

    def __post_init__(self) -> None:
        for name in ("nvidia_modprobe", "systemd_run", "ddops"):
            _check_path(self.TEMPLATE, name, getattr(self, name))
        _check_path(self.TEMPLATE, "inventory", self.inventory, optional=True)
        _check_minors(self.TEMPLATE, self.gpu_minors)


@dataclass(frozen=True)
class EngineUnit(TemplateSpec):
    """The engine's systemd unit inside the CT: `python -m engine serve` with the site's settings,
    as `user` with group `gid` (the GPU nodes' group), sandboxed.

    The API key is never a field: the unit names `env_file`, which holds DDOPS_API_KEY.
    """

    TEMPLATE: ClassVar[str] = "ddops-engine.service.j2"
    INSTALL_PATH: ClassVar[str] = "/etc/systemd/system/ddops-engine.service"

    python: str
    model: str
    draft: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int | None = None  # None: the model's own limit
    max_num_seqs: int | None = None  # None: the engine's default
    kv_cache_tokens: int | None = None  # None: a whole context per sequence
    method: str = "ddtree"
    budget: int = 15
    tp: int = 1
    dtype: str = "bfloat16"
    device: str = "cuda"
    cuda_visible_devices: str | None = None
    env_file: str = "/etc/ddops/engine.env"
    user: str = "ddops-engine"
    gid: int = 44

    def __post_init__(self) -> None:
        t = self.TEMPLATE
        _check_path(t, "python", self.python)
        _check_path(t, "model", self.model)
        _check_path(t, "draft", self.draft, optional=True)
        _check_raw_path(t, "env_file", self.env_file)
        _check_match(t, "user", self.user, USER_NAME)
        _check_int(t, "gid", self.gid, range(1, 65536))
        _check_match(t, "host", self.host, HOST_NAME)
        _check_int(t, "port", self.port, range(1, 65536))
        if self.max_model_len is not None:
            _check_int(t, "max_model_len", self.max_model_len, range(1, 10_000_001))
        if self.max_num_seqs is not None:
            _check_int(t, "max_num_seqs", self.max_num_seqs, range(1, MAX_NUM_SEQS + 1))
        if self.kv_cache_tokens is not None:
            _check_int(t, "kv_cache_tokens", self.kv_cache_tokens, range(1, (1 << 30) + 1))
        _check_choice(t, "method", self.method, METHODS)
        _check_int(t, "budget", self.budget, range(1, 4097))
        _check_int(t, "tp", self.tp, range(1, 65))
        if self.method != "ar" and self.draft is None:
            _fail(t, f"method {self.method} needs a draft model")
        _check_choice(t, "dtype", self.dtype, DTYPES)
        _check_match(t, "device", self.device, DEVICE_NAME)
        if self.cuda_visible_devices is not None:
            _check_match(t, "cuda_visible_devices", self.cuda_visible_devices, CUDA_DEVICE_LIST)
