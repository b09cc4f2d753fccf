"""THE chain of checks: one ordered list, three users (`health` probes, `recover` repairs,
`provision` sets up with the same chain, also creating what is missing).

Each check has a key and a title, a read-only probe that reads facts through the Transport and
returns a Finding (ok, evidence, fixable), the keys of the checks it needs, and ONE remedy (None
when nothing can fix it automatically). A remedy takes `dry_run` and returns an Outcome (ops/chain/report.py)
with the plan and any file diff; it raises DdopsError when it cannot act.

    host -> modules -> nodes -> gpu-majors -> ct-exists -> ct-config -> ct-running -> cuda -> model
    -> service -> engine -> boot-kernel -> bench -> host-ddops -> cgroup-keys
      (+ capacity, gpu-capacity, boot, hookscript, engine-installed, api-key under provision)

The runner that applies them is ops/chain/runner.py. Tests: tests/integration/test_checks.py (one check at a time
on a sim host) and the provision/recover tests (the whole chain).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from ops.agents.staging import SHM_MODELS
from ops.chain import deploy, stage_model
from ops.chain import install as host_install
from ops.chain import setup as host_setup
from ops.chain.report import Mode, Outcome
from ops.chain.stage_model import branch_commit, check_staged
from ops.diffs import unified_diff
from ops.errors import DdopsError
from ops.host.gpu import (
    MAJOR_HISTORY,
    driver_version,
    gpu_facts,
    host_userspace_mountable,
    host_userspace_version,
    loaded_modules,
    open_module_problem,
    parse_char_majors,
    read_major_history,
    record_majors,
    unrecorded_majors,
)
from ops.host.kernels import (
    PIN_RECORD,
    KernelFacts,
    PinRecord,
    kernel_facts,
    module_build,
    pin_record_text,
    read_pin_record,
    running_kernel,
)
from ops.host.lxcconf import (
    HOOK_KEY,
    NVIDIA_LXC_HOOK,
    GpuBlock,
    GpuDevice,
    cgroup_v1_lines,
    find_stale_rules,
    plan_gpu_block,
)
from ops.host.lxcconf import parse as parse_ct_config
from ops.host.pve import (
    ct_config,
    ct_config_lock,
    ct_exec,
    ct_lock,
    ct_set,
    ct_start,
    ct_status,
    ct_stop,
    ct_unlock,
    hotplugs_dev_entries,
    pve_version,
    supports_dev_entries,
)
from ops.host.transport import Transport
from ops.render import TemplateSpec
from ops.results import find_stale_runs, quarantine_run
from ops.site.inventory import ContainerSpec, EngineSpec, HostSpec, ModelRef, ModelSpec

REQUIRED_MODULES = ("nvidia", "nvidia_uvm")
DKMS_BUILD_TIMEOUT_S = 1800.0  # building the NVIDIA module for a kernel takes minutes
PROBE_SCRIPT = (
    Path(__file__).parents[1] / "agents" / "probe.py"
)  # stdlib only: runs in any CT python3
ENGINE_READY_TIMEOUT_S = 300.0
_DEV_LINE = re.compile(r"dev\d+: /dev/\S+")


@dataclass(frozen=True)
class Policy:
    """What a run may do, set once per run by ops.chain.runner.chain_run. Its `mode`: "health"
    probes, "recover" repairs, "provision" repairs and also creates the CT, installs boot
    persistence and the engine, and sets the engine's API key. `unlock` clears a CT lock
    (`pct unlock`) before starting it; `remove_api_key` (provision) turns authentication off;
    `verify_hashes` (health --hashes) checks the staged model's sha256, not only size + mtime;
    `store_hf_token` (provision) keeps HF_TOKEN on the host for the boot-time recovery."""

    mode: Mode = "health"
    unlock: bool = False
    remove_api_key: bool = False
    verify_hashes: bool = False
    store_hf_token: bool = False


@dataclass(frozen=True)
class ChainContext:
    """Everything the checks of one container read: where, what, and what they may do."""

    t: Transport
    ct: ContainerSpec
    model: ModelSpec
    engine: EngineSpec
    policy: Policy = Policy()
    host: HostSpec | None = None  # the CT's host as the inventory has it (None: this CT alone)
    results_dir: Path | None = None
    hf_token: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)  # the operator's, for provision only

    @property
    def vmid(self) -> int:
        return self.ct.vmid

    @property
    def name(self) -> str:
        return f"CT {self.ct.vmid}"

    @property
    def host_vmids(self) -> tuple[int, ...]:
        """Every GPU CT of this host: the boot unit recovers them all."""
        return tuple(ct.vmid for ct in self.host.containers) if self.host else (self.vmid,)

    @property
    def models(self) -> list[ModelRef]:
        return [m for m in (self.model.target, self.model.draft) if m is not None]


@dataclass(frozen=True)
class Finding:
    """What a probe found: ok, the evidence in words, and whether a remedy may fix it."""

    ok: bool
    evidence: str
    fixable: bool = True


Probe = Callable[[ChainContext], Finding]
Remedy = Callable[[ChainContext, bool], Outcome]


@dataclass(frozen=True)
class Check:
    """One link of the chain: `needs` names the checks whose failure makes this one moot."""

    key: str
    title: str
    probe: Probe
    remedy: Remedy | None
    needs: tuple[str, ...] = ()
    # What only provision does: "check", the whole check (health and recover leave it out);
    # "remedy", its remedy (e.g. creating a CT: health and recover only report it)
    provision_only: Literal["check", "remedy"] | None = None

    def __post_init__(self) -> None:
        if self.provision_only not in (None, "check", "remedy"):
            raise ValueError(f"{self.key}: provision_only is 'check', 'remedy' or None")


def _ok(evidence: str) -> Finding:
    return Finding(True, evidence)


def _bad(evidence: str, fixable: bool = True) -> Finding:
    return Finding(False, evidence, fixable)


def _ran(t: Transport, argv: list[str], dry_run: bool, obj: str) -> Outcome:
    """Run a host command (or say it would)."""
    if dry_run:
        return Outcome(True, f"would run `{shlex.join(argv)}`")
    t.run(argv).check(obj)
    return Outcome(True, f"ran `{shlex.join(argv)}`")


# -- 1. host reachable -----------------------------------------------------------------------
def probe_host(c: ChainContext) -> Finding:
    return _ok(f"{c.t.label}: Proxmox VE {pve_version(c.t)}")


# -- 2. nvidia kernel modules ----------------------------------------------------------------
def probe_modules(c: ChainContext) -> Finding:
    loaded = loaded_modules(c.t)
    missing = [m for m in REQUIRED_MODULES if m not in loaded]
    if "nvidia" in missing and (facts := _running_without_module(c)):
        return _bad(
            f"{c.t.label}: {facts.one_line()}: rebuild it (`dkms autoinstall -k {facts.running}`, "
            f"with proxmox-headers-{facts.running}) or {way_back(facts)}"
        )
    if missing:
        return _bad(f"{c.t.label}: kernel module(s) {', '.join(missing)} not loaded")
    if problem := open_module_problem(c.t):
        return _bad(f"{c.t.label}: {problem}", fixable=False)
    return _ok(f"{', '.join(REQUIRED_MODULES)} loaded")


def _running_without_module(c: ChainContext) -> KernelFacts | None:
    """The host's kernel facts when the running kernel has no nvidia module (None: it has one)."""
    if module_build(c.t, running_kernel(c.t)) is not None:
        return None
    return kernel_facts(c.t)


def way_back(facts: KernelFacts) -> str:
    """How to boot a kernel that has the module again, in the commands' own words."""
    if previous := facts.previous_with_module():
        return f"boot {previous} again: `proxmox-boot-tool kernel pin {previous} --next-boot` and reboot"
    return "no installed kernel has it: reinstall the NVIDIA driver for this kernel"


def load_modules(c: ChainContext, dry_run: bool) -> Outcome:
    modprobe = ["modprobe", "-a", *REQUIRED_MODULES]
    if "nvidia" in loaded_modules(c.t) or not (facts := _running_without_module(c)):
        return _ran(c.t, modprobe, dry_run, c.t.label)
    rebuild = ["dkms", "autoinstall", "-k", facts.running]
    if not c.t.exists(f"/lib/modules/{facts.running}/build"):
        raise DdopsError(
            c.t.label,
            f"{facts.one_line()}: no headers to rebuild it (proxmox-headers-{facts.running}); "
            f"{way_back(facts)}",
        )
    if dry_run:
        return Outcome(True, f"would run `{shlex.join(rebuild)}`, then `{shlex.join(modprobe)}`")
    built = c.t.run(rebuild, timeout=DKMS_BUILD_TIMEOUT_S)
    if not built.ok or module_build(c.t, facts.running) is None:
        said = [line for line in (built.stderr + built.stdout).splitlines() if line.strip()]
        raise DdopsError(
            c.t.label,
            f"{facts.one_line()}: `{shlex.join(rebuild)}` failed "
            f"({said[0] if said else f'exit {built.rc}'}); {way_back(facts)}",
        )
    return Outcome(
        True, f"ran `{shlex.join(rebuild)}`; " + _ran(c.t, modprobe, False, c.t.label).detail
    )


# -- the kernel the host boots next has the module; the hook's pin -----------------------------
def _ours(record: PinRecord | None, facts: KernelFacts) -> bool:
    """Whether the kernel pinned now is the one ddops pinned (its record says so)."""
    return record is not None and facts.selection.pinned == record.pinned


def probe_boot_kernel(c: ChainContext) -> Finding:
    facts, record = kernel_facts(c.t), read_pin_record(c.t)
    named = f"{c.t.label}: running {facts.running}, next boot {facts.next_boot}"
    if facts.without_module(facts.next_boot):
        cts = ", ".join(map(str, c.host_vmids))
        said = (
            f"{named}, which has no nvidia module (driver {facts.driver() or '?'}; dkms status: "
            f"{facts.dkms or 'nothing'}): a reboot now would leave CT(s) {cts} without CUDA"
        )
        if facts.without_module(facts.running):
            return _bad(f"{said}; no installed kernel has the module to pin", fixable=False)
        hand = facts.selection.next_boot_pin or facts.selection.pinned
        if hand and not _ours(record, facts):
            return _bad(
                f"{said}; {hand} is pinned by hand: `proxmox-boot-tool kernel pin {facts.running}`"
                " keeps the running kernel",
                fixable=False,
            )
        return _bad(f"{said}; recover pins {facts.running} until {facts.next_boot} has one")
    if _ours(record, facts) and not facts.without_module(facts.selection.unpinned):
        return _bad(
            f"{named}: ddops pinned {record.pinned} when {record.new} got no nvidia module; "
            f"{facts.selection.unpinned} has one now: the pin can go"
        )
    if _ours(record, facts):
        return _ok(
            f"{named}; warning: {record.new} got no nvidia module, so ddops pinned "
            f"{record.pinned} ({record.when}); recover lifts the pin once {record.new} has one"
        )
    return _ok(f"{named}, which has nvidia {facts.module(facts.next_boot).version}")


def pin_boot_kernel(c: ChainContext, dry_run: bool) -> Outcome:
    """Pin the running kernel (recorded as ddops'), or lift ddops' pin once it is not needed."""
    facts, record = kernel_facts(c.t), read_pin_record(c.t)
    refresh = ["proxmox-boot-tool", "refresh"]
    if facts.without_module(facts.next_boot):
        pin = ["proxmox-boot-tool", "kernel", "pin", facts.running]
        if dry_run:
            return Outcome(True, f"would run `{shlex.join(pin)}` and record it in {PIN_RECORD}")
        c.t.run(pin).check(c.t.label)
        c.t.run(refresh).check(c.t.label)
        when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        c.t.write_file(PIN_RECORD, pin_record_text(PinRecord(facts.running, facts.next_boot, when)))
        return Outcome(
            True, f"ran `{shlex.join(pin)}` ({facts.next_boot} has no nvidia module); recorded"
        )
    unpin = ["proxmox-boot-tool", "kernel", "unpin"]  # it drops a next-boot pin too: put back
    again = [unpin[0], "kernel", "pin", facts.selection.next_boot_pin, "--next-boot"]
    steps = [unpin] + ([again] if facts.selection.next_boot_pin else []) + [refresh]
    if dry_run:
        return Outcome(True, "would run " + ", ".join(f"`{shlex.join(a)}`" for a in steps))
    for argv in steps:
        c.t.run(argv).check(c.t.label)
    c.t.run(["rm", "-f", c.t.host_path(PIN_RECORD)]).check(c.t.label)
    return Outcome(
        True,
        f"lifted ddops' pin of {record.pinned}: the next boot runs "
        f"{facts.selection.next_boot_pin or facts.selection.unpinned}",
    )


# -- 3. device nodes -------------------------------------------------------------------------
def required_nodes(ct: ContainerSpec) -> list[str]:
    """The nodes CUDA opens in the CT: one per GPU, the control node and the two uvm nodes."""
    gpus = [f"/dev/nvidia{minor}" for minor in ct.gpus]
    return [*gpus, "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]


def probe_nodes(c: ChainContext) -> Finding:
    facts = gpu_facts(c.t)
    problems = []
    for path in required_nodes(c.ct):
        node = facts.node(path)
        if node is None or node.kind != "char":
            problems.append(f"{path} is missing")
        elif path.startswith("/dev/nvidia-uvm") and node.major != facts.majors.uvm:
            problems.append(f"{path} has major {node.major}, the driver holds {facts.majors.uvm}")
    if problems:
        return _bad(f"{c.t.label}: {'; '.join(problems)}")
    return _ok(f"{len(required_nodes(c.ct))} nodes present, uvm major {facts.majors.uvm}")


def create_nodes(c: ChainContext, dry_run: bool) -> Outcome:
    outcomes = [
        _ran(c.t, ["nvidia-modprobe", "-u", f"-c={minor}"], dry_run, c.t.label)
        for minor in c.ct.gpus
    ]
    return Outcome(True, "; ".join(o.detail for o in outcomes))


# -- the host's NVIDIA majors remembered: how a stale grant is known after the major moved -----
def _char_majors(c: ChainContext) -> dict[str, int]:
    return parse_char_majors(c.t.read_text("/proc/devices"))


def _named(majors: dict[int, str]) -> str:
    return ", ".join(f"{major} ({name})" for major, name in sorted(majors.items()))


def probe_gpu_majors(c: ChainContext) -> Finding:
    if new := unrecorded_majors(c.t, _char_majors(c)):
        return _bad(f"{c.t.label}: NVIDIA major(s) {_named(new)} not yet in {MAJOR_HISTORY}")
    return _ok(f"NVIDIA majors recorded in {MAJOR_HISTORY}")


def record_gpu_majors(c: ChainContext, dry_run: bool) -> Outcome:
    if dry_run:
        new = unrecorded_majors(c.t, _char_majors(c))
        return Outcome(True, f"would record {_named(new)} in {MAJOR_HISTORY}")
    return Outcome(
        True, f"recorded {_named(record_majors(c.t, _char_majors(c)))} in {MAJOR_HISTORY}"
    )


# -- CT exists (created by provision only) ---------------------------------------------------
def probe_ct_exists(c: ChainContext) -> Finding:
    if ct_status(c.t, c.vmid) is None:
        return _bad(f"{c.name} does not exist on {c.t.label}")
    return _ok(f"{c.name} exists{_privilege_words(c)}")


def _privileged(c: ChainContext) -> bool:
    return ct_config(c.t, c.vmid).get("unprivileged", "0") != "1"


def _privilege_words(c: ChainContext) -> str:
    """A warning for a privileged CT the inventory did not ask for: ddops never converts one
    (its files would need their owners shifted), it says so."""
    if not _privileged(c):
        return ", unprivileged"
    if c.ct.privileged:
        return ", privileged as the inventory asks"
    return (
        f"; warning: {c.name} is privileged (root in it is root on the host): ddops does not "
        "convert it; recreate it unprivileged, or say `privileged: true` in the inventory"
    )


def create_ct(c: ChainContext, dry_run: bool) -> Outcome:
    return _ran(c.t, host_setup.pct_create_argv(c.ct), dry_run, c.name)


# -- capacity and recovery at boot (provision only) ------------------------------------------
def probe_capacity(c: ChainContext) -> Finding:
    problem = host_setup.capacity_problem(c.ct, c.models, c.model.hub_endpoint, c.hf_token)
    return (
        _bad(problem, fixable=False) if problem else _ok(f"{c.name}: memory holds model + engine")
    )


def probe_gpu_capacity(c: ChainContext) -> Finding:
    fit = host_setup.gpu_capacity(c.t, c.ct, c.model, c.engine, c.hf_token)
    return _bad(fit.problem, fixable=False) if fit.problem else _ok(fit.evidence)


def _boot_specs(c: ChainContext) -> list[TemplateSpec]:
    return host_setup.boot_specs(c.ct.gpus, c.host_vmids, c.t.host_path(PIN_RECORD))


def probe_boot(c: ChainContext) -> Finding:
    problems = host_setup.boot_problems(c.t, _boot_specs(c))
    if problems:
        return _bad(f"{c.t.label}: {'; '.join(problems)}")
    return _ok(
        "modules-load file, GPU-node and recover units installed and enabled; kernel hook installed"
    )


def install_boot(c: ChainContext, dry_run: bool) -> Outcome:
    return host_setup.install_boot(c.t, _boot_specs(c), dry_run)


# -- the CT hookscript (provision only): device nodes before each start, recovery after ------
def _hookscript(c: ChainContext):
    return host_setup.hookscript(c.t, c.ct.gpus)


def probe_hookscript(c: ChainContext) -> Finding:
    problems, other = host_setup.hookscript_problems(c.t, c.vmid, _hookscript(c))
    if other:
        return _ok(f"{c.name} has its own hookscript {other}: ddops leaves it")
    if problems:
        return _bad(f"{c.name}: {'; '.join(problems)}")
    return _ok(f"{c.name}: hookscript {_hookscript(c).PVE_VOLUME} attached")


def install_hookscript(c: ChainContext, dry_run: bool) -> Outcome:
    return host_setup.install_hookscript(c.t, c.vmid, _hookscript(c), dry_run)


# -- 4. the CT config grants the current majors ----------------------------------------------
def _config_path(c: ChainContext) -> str:
    return f"/etc/pve/lxc/{c.vmid}.conf"


def desired_gpu_block(c: ChainContext) -> GpuBlock:
    """The GPU block for the nodes as they are now (their majors read from the host). LXC's
    NVIDIA mount hook is part of it where the host has libnvidia-container and the CT is
    unprivileged: the hook refuses to run outside a user namespace (so a privileged CT with it
    would not start), and inside one it runs `nvidia-container-cli --user configure
    --no-cgroups` itself. NVIDIA's config.toml `no-cgroups` key is read by its OCI hook
    (Docker, Podman), not by this one: ddops leaves that file alone."""
    facts = gpu_facts(c.t)
    devices = []
    for path in required_nodes(c.ct):
        node = facts.node(path)
        if node is None:
            raise DdopsError(c.t.label, f"{path} is missing: cannot grant it to {c.name}")
        devices.append(GpuDevice(path, node.major, node.minor, gid=c.ct.gpu_gid))
    style = c.ct.device_style
    if style == "auto":
        style = "devN" if supports_dev_entries(pve_version(c.t)) else "raw"
    return GpuBlock(
        tuple(devices),
        style=style,
        shm_size_gib=c.ct.shm_gib,
        host_userspace=host_userspace_mountable(c.t) and not _privileged(c),
    )


@dataclass(frozen=True)
class _PlannedConfig:
    text: str  # the config now
    planned: str  # the config with the wanted GPU block
    stale: tuple[str, ...]  # the stale grants the edit removes, as their lines read
    evidence: list[str]  # why the config is not as wanted, in words


def _planned_config(c: ChainContext) -> _PlannedConfig:
    """The config now and as wanted. Stale grants (rules for a major that was NVIDIA's, in the
    host's history or ddops' mark, and is no longer) are part of what the edit removes."""
    text = c.t.read_text(_config_path(c))
    majors, history = _char_majors(c), read_major_history(c.t)
    planned = plan_gpu_block(text, desired_gpu_block(c), majors, history)
    report = find_stale_rules(text, majors, history)
    stale = tuple(line.text for line in report.stale)
    return _PlannedConfig(text, planned, stale, report.evidence())


def probe_ct_config(c: ChainContext) -> Finding:
    config = _planned_config(c)
    if config.planned == config.text:
        return _ok(f"{c.name}: the config grants the current majors")
    evidence = config.evidence or ["the GPU block differs from the inventory's"]
    return _bad("; ".join(f"{c.name}: {line}" for line in evidence))


def _added_dev_entries(config: _PlannedConfig) -> dict[str, str]:
    """The devN entries the planned config adds, when adding them is all it changes; else {}."""
    now, planned = config.text.splitlines(), config.planned.splitlines()
    added = [line for line in planned if line not in now]
    if [line for line in planned if line in now] != now:
        return {}
    entries = dict(line.split(": ", 1) for line in added if _DEV_LINE.fullmatch(line))
    return entries if len(entries) == len(added) else {}


def hotplug_ct_config(c: ChainContext, config: _PlannedConfig, dry_run: bool) -> Outcome | None:
    """On a host that hot-plugs devN entries (PVE 9), add the new ones to the running CT through
    `pct set`, with no restart; None where that is not all the edit does (then as before). A
    node the CT still lacks afterwards (Proxmox could not attach it; its warning, quoted in the
    outcome, says why) restarts it."""
    entries = _added_dev_entries(config)
    if not entries or not hotplugs_dev_entries(pve_version(c.t)):
        return None
    added = ", ".join(f"`{k}: {v}`" for k, v in entries.items())
    if dry_run:
        diff = unified_diff(config.text, config.planned, _config_path(c))
        return Outcome(True, f"would add {added} with pct set, hot-plugged (no restart)", diff)
    said = ct_set(c.t, c.vmid, entries).stderr
    with ct_config_lock(c.t, c.vmid):  # pct set's own order of the keys: ddops' block order
        now = _planned_config(c)
        reordered = sorted(now.planned.splitlines()) == sorted(now.text.splitlines())
        if reordered and now.planned != now.text:
            c.t.write_file(_config_path(c), now.planned)
    diff = unified_diff(config.text, config.planned, _config_path(c))
    paths = [value.split(",")[0] for value in entries.values()]
    missing = [p for p in paths if not ct_exec(c.t, c.vmid, ["test", "-c", p]).ok]
    if missing:
        restart_ct(c)
        why = "; ".join(line for line in said.splitlines() if "unable to hotplug" in line)
        return Outcome(
            True,
            f"added {added} with pct set; {', '.join(missing)} not attached"
            f"{f' (pct: {why})' if why else ''}: restarted",
            diff,
        )
    return Outcome(True, f"added {added} with pct set, hot-plugged: not restarted", diff)


def write_ct_config(c: ChainContext, dry_run: bool) -> Outcome:
    path = _config_path(c)
    running = ct_status(c.t, c.vmid) == "running"
    if running and (hotplugged := hotplug_ct_config(c, _planned_config(c), dry_run)):
        return hotplugged
    then = "; restart the CT to apply it" if running else ""
    if dry_run:
        config = _planned_config(c)
        removes = _stale_words(config.stale)
        diff = unified_diff(config.text, config.planned, path)
        return Outcome(True, f"would write {path}{removes}{then}", diff)
    with ct_config_lock(c.t, c.vmid):  # pct set's lock: no edit is lost between read and write
        config = _planned_config(c)
        backup = c.t.write_file(path, config.planned)
    diff = unified_diff(config.text, config.planned, path)
    if running:
        restart_ct(c)
    done = f"wrote {path} (backup {backup}){_stale_words(config.stale)}"
    return Outcome(True, done + ("; restarted" if running else ""), diff)


def _stale_words(stale: tuple[str, ...]) -> str:
    return f", removing stale grant(s) {'; '.join(f'`{s}`' for s in stale)}" if stale else ""


def restart_ct(c: ChainContext) -> None:
    """Stop and start the CT: device grants and mounts apply at start."""
    ct_stop(c.t, c.vmid)
    ct_start(c.t, c.vmid)


# -- 5. CT not locked, running ---------------------------------------------------------------
def probe_ct_running(c: ChainContext) -> Finding:
    lock = ct_lock(c.t, c.vmid)
    if lock and not c.policy.unlock:
        return _bad(
            f"{c.name} is locked ({lock}): once the {lock} is over, rerun with --unlock "
            f"(or `pct unlock {c.vmid}`)",
            fixable=False,
        )
    status = ct_status(c.t, c.vmid)
    if lock or status != "running":
        return _bad(f"{c.name} is {status}" + (f" and locked ({lock})" if lock else ""))
    return _ok(f"{c.name} is running")


def start_ct(c: ChainContext, dry_run: bool) -> Outcome:
    lock = ct_lock(c.t, c.vmid)
    actions = ([f"pct unlock {c.vmid} ({lock})"] if lock else []) + [f"pct start {c.vmid}"]
    if dry_run:
        return Outcome(True, "would run " + ", ".join(actions))
    if lock:
        ct_unlock(c.t, c.vmid)
    ct_start(c.t, c.vmid)
    return Outcome(True, "ran " + ", ".join(actions))


# -- 6. CUDA initialises in the CT; its driver userspace matches the host module -------------
def cuda_probe_report(c: ChainContext) -> dict:
    """The CUDA probe (ops/agents/probe.py, stdlib only) run inside the CT from stdin: nothing written."""
    r = ct_exec(c.t, c.vmid, ["python3", "-I", "-S", "-", "--json"], input=PROBE_SCRIPT.read_text())
    try:
        return json.loads(r.stdout)
    except ValueError:
        raise DdopsError(
            c.name, f"the CUDA probe gave no report: {r.stderr.strip()[-300:]}"
        ) from None


def probe_cuda(c: ChainContext) -> Finding:
    report = cuda_probe_report(c)
    host_version = driver_version(c.t)
    ct_version = report.get("userspace_driver_version")
    if report["verdict"] == "mismatch" or (ct_version and ct_version != host_version):
        return _userspace_mismatch(c, ct_version, host_version)
    if report["verdict"] != "ok":
        return _bad(f"{c.name}: {report['reason']}")
    return _ok(f"{c.name}: cuInit ok, driver {host_version} on host and in the CT")


def _userspace_mismatch(c: ChainContext, ct_version: str | None, module: str | None) -> Finding:
    """The CT's driver userspace is not the host module's version (compared in full: 570.148.06
    is not 570.148.08). Where LXC's NVIDIA hook gives the CT the host's own userspace, a restart
    brings the CT in step, unless the host itself is not (upgraded, not yet rebooted)."""
    said = f"{c.name}: driver userspace {ct_version} does not match the host kernel module {module}"
    if not _config_mounts_host_userspace(c) and _privileged(c):
        return _bad(
            f"{said}: install the {module} userspace in the CT (NVIDIA-Linux-x86_64-{module}.run "
            f"--no-kernel-module); LXC's NVIDIA mount hook, which would mount the host's own, "
            f"runs in unprivileged CTs only and {c.name} is privileged",
            fixable=False,
        )
    if not _config_mounts_host_userspace(c):
        return _bad(
            f"{said}: install the {module} userspace in the CT (NVIDIA-Linux-x86_64-{module}.run "
            "--no-kernel-module), or libnvidia-container-tools on the host: ddops then mounts the "
            "host's own userspace into the CT at each start",
            fixable=False,
        )
    host = host_userspace_version(c.t)
    if host is not None and host != module:
        return _bad(
            f"{said}; the host's own userspace is {host}: the host awaits a reboot into the "
            f"{host} module (the CT gets {host} at its next start)",
            fixable=False,
        )
    return _bad(f"{said}: a restart mounts the host's {module} userspace into the CT")


def _config_mounts_host_userspace(c: ChainContext) -> bool:
    return any(
        line.key == HOOK_KEY and line.value.strip() == NVIDIA_LXC_HOOK
        for line in parse_ct_config(c.t.read_text(_config_path(c))).main.entries()
    )


def restart_for_cuda(c: ChainContext, dry_run: bool) -> Outcome:
    if dry_run:
        return Outcome(True, f"would restart {c.name} so its device grants and driver apply")
    restart_ct(c)
    return Outcome(True, f"restarted {c.name} so its device grants and driver apply")


# -- engine installed (provision only) -------------------------------------------------------
def probe_engine_installed(c: ChainContext) -> Finding:
    problem = deploy.engine_problem(c.t, c.vmid, c.engine)
    return _bad(problem) if problem else _ok(f"{c.engine.python} imports the engine")


def install_engine(c: ChainContext, dry_run: bool) -> Outcome:
    if dry_run:
        return Outcome(True, f"would install the engine for {c.engine.python} in {c.name}")
    return deploy.install_engine(c.t, c.vmid, c.engine)


# -- 7. the model is complete in /dev/shm ----------------------------------------------------
def model_dir(ref: ModelRef) -> str:
    return f"{SHM_MODELS}/{ref.name}"


def probe_model(c: ChainContext) -> Finding:
    names = [ref.name for ref in c.models]
    checked = check_staged(
        c.t, c.vmid, names, python=c.engine.python, hashes=c.policy.verify_hashes
    )
    staged = {ref: checked[ref.name] for ref in c.models}
    problems = [f"{model_dir(ref)}: {p}" for ref, s in staged.items() for p in s.problems]
    if problems:
        return _bad(f"{c.name}: {'; '.join(problems)}")
    complete = f"{c.name}: {', '.join(model_dir(ref) for ref in c.models)} complete"
    moved = [
        f"{ref.repo} {ref.revision} is at {now[:12]}, {ref.name} was staged from "
        f"{(s.commit or '?')[:12]}"
        for ref, s in staged.items()
        if (now := branch_commit(ref, c.model.hub_endpoint, c.hf_token)) and now != s.commit
    ]
    if moved and c.policy.mode == "provision":  # provision brings the inventory's revision
        return _bad(f"{c.name}: {'; '.join(moved)}")
    if moved:  # health and recover keep what was staged: an upgrade is the operator's call
        return _ok(f"{complete}; upgrade available: {'; '.join(moved)} (`ddops provision`)")
    return _ok(complete)


def stage_models(c: ChainContext, dry_run: bool) -> Outcome:
    if dry_run:
        return Outcome(True, f"would stage {', '.join(m.repo for m in c.models)} (cache first)")
    reports = stage_model.stage_models(
        c.t,
        c.vmid,
        c.models,
        python=c.engine.python,
        endpoint=c.model.hub_endpoint,
        token=c.hf_token,
        refresh=c.policy.mode == "provision",
    )
    done = []
    for ref, report in zip(c.models, reports, strict=True):
        source = f"{len(report.downloaded_files) + len(report.repaired_cache_files)} file(s) from the hub"
        done.append(
            f"{ref.name}@{report.commit[:12]}: {len(report.copied_files)} file(s) copied, {source}"
        )
    return Outcome(True, "staged " + "; ".join(done))


# -- the engine's API key (provision only: recover and the boot units keep what is installed) --
def probe_api_key(c: ChainContext) -> Finding:
    change = deploy.api_key_change(c.t, c.vmid, c.api_key, c.policy.remove_api_key)
    if change is not None:
        return _bad(f"{c.name}: {change.evidence}")
    if c.policy.remove_api_key:
        return _ok(f"{c.name}: no API key, as --no-api-key asks")
    return _ok(f"{c.name}: API key installed in {deploy.ENV_FILE}")


def set_api_key(c: ChainContext, dry_run: bool) -> Outcome:
    change = deploy.api_key_change(c.t, c.vmid, c.api_key, c.policy.remove_api_key)
    running = deploy.service_manager(c.t, c.vmid).state().running
    then = "; restart the engine" if running else ""
    if dry_run:
        return Outcome(True, f"would {change.action} the API key in {deploy.ENV_FILE}{then}")
    done = deploy.apply_api_key(c.t, c.vmid, change, c.api_key)
    if running:
        deploy.restart_service(c.t, c.vmid)
        deploy.wait_ready(c.t, c.vmid, c.engine, ENGINE_READY_TIMEOUT_S)
    return Outcome(True, done + ("; restarted the engine" if running else ""))


# -- 8. engine service running; 9. engine healthy --------------------------------------------
def probe_service(c: ChainContext) -> Finding:
    problem = deploy.service_problem(c.t, c.vmid)
    return _bad(problem) if problem else _ok(f"{c.name}: the engine service is running")


def engine_deployment(c: ChainContext) -> deploy.EngineDeployment:
    """The engine's service in this CT: the inventory's settings over the staged models."""
    draft = model_dir(c.model.draft) if c.model.draft else None
    target = model_dir(c.model.target)
    return deploy.EngineDeployment(c.vmid, c.engine, target, draft, len(c.ct.gpus), c.ct.gpu_gid)


def ensure_service(c: ChainContext, dry_run: bool) -> Outcome:
    manager = deploy.service_manager(c.t, c.vmid)
    outcome = deploy.ensure_service(c.t, engine_deployment(c), dry_run, manager)
    if not dry_run:
        deploy.wait_ready(c.t, c.vmid, c.engine, ENGINE_READY_TIMEOUT_S, manager)
    return outcome


def probe_engine(c: ChainContext) -> Finding:
    health = deploy.engine_health(c.t, c.vmid, c.engine)
    if health.problem:
        return _bad(health.problem)
    auth = "API key required" if health.key_required else "no API key: anyone who reaches it"
    return _ok(f"{c.name}: /ready ok and a generation answered; {auth}")


def restart_engine(c: ChainContext, dry_run: bool) -> Outcome:
    if dry_run:
        return Outcome(True, f"would restart the engine in {c.name}")
    outcome = deploy.restart_service(c.t, c.vmid)
    deploy.wait_ready(c.t, c.vmid, c.engine, ENGINE_READY_TIMEOUT_S)
    return dataclasses.replace(outcome, changed=True)


# -- no cgroup v1 keys on a cgroup v2 only host (PVE 9) -----------------------------------------
CGROUP_V2_ONLY_FROM = 9  # pve8to9: "support for the hybrid cgroup hierarchy is removed"


def probe_cgroup_keys(c: ChainContext) -> Finding:
    """A `lxc.cgroup.*` line in the CT's main section: ignored on PVE 7+, warned about by PVE 9's
    pve-container ("will be a hard error"), refused by LXC 7. ddops never writes one; those of
    the GPU block it owns go with the ct-config check, any other is the operator's to change."""
    found = cgroup_v1_lines(c.t.read_text(_config_path(c)))
    if not found:
        return _ok(f"{c.name}: no lxc.cgroup.* key")
    version = pve_version(c.t)
    lines = "; ".join(f"line {line.number}: `{line.text}`" for line in found)
    if version.major < CGROUP_V2_ONLY_FROM:
        return _ok(f"{c.name}: cgroup v1 key(s), ignored on PVE {version} (cgroup v2): {lines}")
    return _bad(
        f"{c.name}: {lines}: cgroup v1 key(s) on PVE {version}, which has cgroup v2 only: LXC "
        f"ignores them and pve-container will refuse them; write lxc.cgroup2.* instead (or drop "
        f"them) in {_config_path(c)}",
        fixable=False,
    )


# -- 10. no stale bench runs -----------------------------------------------------------------
def probe_bench(c: ChainContext) -> Finding:
    if c.results_dir is None:
        return _ok("no results directory")
    stale = find_stale_runs(c.results_dir)
    if stale:
        names = ", ".join(p.name for p in stale)
        return _bad(f"{c.results_dir}: run(s) {names} say running but their process is gone")
    return _ok(f"{c.results_dir}: no stale runs")


def quarantine_runs(c: ChainContext, dry_run: bool) -> Outcome:
    stale = find_stale_runs(c.results_dir)
    if dry_run:
        return Outcome(True, f"would mark {len(stale)} run(s) crashed and move their partial files")
    moved = [str(quarantine_run(run)) for run in stale]
    return Outcome(True, f"marked crashed, partial files moved to {', '.join(moved)}")


# -- ddops itself on the host, for the boot units (repaired by provision only) ---------------
def _host_site_text(c: ChainContext) -> str:
    host = c.host or HostSpec("this", host_install.local_target(c.t), (c.ct,))
    return host_install.host_site_text(c.t, host, c.model, c.engine)


def _stores_token(c: ChainContext) -> bool:
    return c.policy.mode == "provision" and c.policy.store_hf_token and c.hf_token is not None


def probe_host_ddops(c: ChainContext) -> Finding:
    problems = host_install.host_problems(c.t, _host_site_text(c))
    if _stores_token(c) and (problem := host_install.hf_token_problem(c.t, c.hf_token)):
        problems.append(problem)
    if problems:
        return _bad(f"{c.t.label}: {'; '.join(problems)}")
    return _ok(f"ddops {host_install.ddops_version()} and {host_install.HOST_SITE} on the host")


def install_host_ddops(c: ChainContext, dry_run: bool) -> Outcome:
    site_text = _host_site_text(c)
    path = host_install.HOST_SITE
    current = c.t.read_text(path) if c.t.exists(path) else ""
    diff = unified_diff(current, site_text, path) if current != site_text else ""
    done = [
        step
        for step in (
            host_install.install_host_ddops(c.t, dry_run),
            host_install.write_host_site(c.t, site_text, dry_run),
            host_install.store_hf_token(c.t, c.hf_token, dry_run) if _stores_token(c) else None,
        )
        if step
    ]
    return Outcome(bool(done), "; ".join(done) or "in step", diff)


# -- the chain -------------------------------------------------------------------------------
CHAIN: tuple[Check, ...] = (
    Check("host", "host reachable", probe_host, None),
    Check(
        "capacity",
        "CT memory holds model + engine",
        probe_capacity,
        None,
        ("host",),
        provision_only="check",
    ),
    Check("modules", "nvidia kernel modules loaded", probe_modules, load_modules, ("host",)),
    Check("nodes", "/dev/nvidia* and uvm nodes", probe_nodes, create_nodes, ("modules",)),
    Check(
        "gpu-majors",
        "NVIDIA majors remembered",
        probe_gpu_majors,
        record_gpu_majors,
        ("modules",),
    ),
    Check(
        "gpu-capacity",
        "GPU memory holds the engine's plan",
        probe_gpu_capacity,
        None,
        ("nodes",),
        provision_only="check",  # before anything is created: nothing to undo when it fails
    ),
    Check(
        "boot",
        "recovery at boot installed",
        probe_boot,
        install_boot,
        ("host",),
        provision_only="check",
    ),
    Check(
        "ct-exists",
        "CT exists",
        probe_ct_exists,
        create_ct,
        ("host",),
        provision_only="remedy",
    ),
    Check(
        "ct-config",
        "CT config grants current majors",
        probe_ct_config,
        write_ct_config,
        ("nodes", "ct-exists"),
    ),
    Check("ct-running", "CT unlocked and running", probe_ct_running, start_ct, ("ct-exists",)),
    Check(
        "hookscript",
        "CT hookscript attached",
        probe_hookscript,
        install_hookscript,
        ("ct-running",),  # after the lock check: `pct set` is refused on a locked CT
        provision_only="check",
    ),
    Check(
        "cuda",
        "CUDA initialises in the CT",
        probe_cuda,
        restart_for_cuda,
        ("ct-config", "ct-running"),
    ),
    Check(
        "engine-installed",
        "engine installed in the CT",
        probe_engine_installed,
        install_engine,
        ("ct-running",),
        provision_only="check",
    ),
    Check("model", "model complete in /dev/shm", probe_model, stage_models, ("ct-running",)),
    Check(
        "api-key",
        "engine API key set",
        probe_api_key,
        set_api_key,
        ("ct-running",),
        provision_only="check",
    ),
    Check("service", "engine service running", probe_service, ensure_service, ("model", "cuda")),
    Check("engine", "engine answers a generation", probe_engine, restart_engine, ("service",)),
    Check(
        "boot-kernel",
        "next boot's kernel has nvidia",
        probe_boot_kernel,
        pin_boot_kernel,
        ("modules",),  # after the engine: the CTs first, the next boot then
    ),
    Check("bench", "no stale bench runs", probe_bench, quarantine_runs),
    # Last, so that a stale host-side ddops never keeps recover from repairing the CT.
    Check(
        "host-ddops",
        "host's own ddops and its site file",
        probe_host_ddops,
        install_host_ddops,
        ("host",),
        provision_only="remedy",
    ),
    Check(
        "cgroup-keys",
        "no cgroup v1 keys in CT config",
        probe_cgroup_keys,
        None,
        ("ct-exists",),  # last: an operator's key never keeps a repair from running
    ),
)


def chain_for(mode: Mode) -> list[Check]:
    """The checks a run in `mode` goes through, in order."""
    return [check for check in CHAIN if mode == "provision" or check.provision_only != "check"]
