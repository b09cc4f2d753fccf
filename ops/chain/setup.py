"""What only `ddops provision` sets up (recover never does): the CT itself, recovery at every boot,
and the check that the CT's memory can hold the model at all.

    pct_create_argv(ct)                              # `pct create` from the inventory
    specs = boot_specs(gpu_minors, vmids, record)    # what recovery at boot needs:
        /etc/modules-load.d/ddops-nvidia.conf          nvidia + nvidia_uvm load at boot
        /etc/systemd/system/ddops-gpu-nodes.service    nvidia-modprobe, Before=pve-guests.service
        /etc/systemd/system/ddops-recover.service      `ddops recover --ct N`, After=pve-guests
        /etc/kernel/postinst.d/zz-ddops-nvidia         a kernel without the module never boots next
      both units enabled (linked into multi-user.target.wants/, what `systemctl enable` does)
    boot_problems(t, specs); install_boot(t, specs, dry_run)
    capacity_problem(ct, models, endpoint, token)    # memory >= model + engine; /dev/shm >= model
    gpu_capacity(t, ct, model, engine, token)        # the engine's memory plan fits the GPUs

The chain (ops/chain/checks.py) wraps these into its provision-only checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ops.agents.staging import hub_errors
from ops.chain.deploy import engine_device_dtype
from ops.chain.install import HF_TOKEN_FILE, HOST_DDOPS, HOST_SITE
from ops.chain.report import Outcome
from ops.diffs import unified_diff
from ops.host.gpu import gpu_memory
from ops.host.pve import ct_config, validate_vmid
from ops.host.transport import Transport
from ops.render import (
    GpuNodesUnit,
    Hookscript,
    KernelHook,
    NvidiaModules,
    RecoverUnit,
    TemplateSpec,
    render,
)
from ops.site.inventory import ContainerSpec, EngineSpec, ModelRef, ModelSpec

WANTS_DIR = "/etc/systemd/system/multi-user.target.wants"
ENGINE_RUNTIME_MIB = 2048  # Python + torch + CUDA context of the engine, beside the weights
MIB = 1 << 20


# -- the CT ------------------------------------------------------------------------------------
def pct_create_argv(ct: ContainerSpec) -> list[str]:
    """`pct create` for the inventory's container (the GPU block is added by the next check):
    unprivileged unless the inventory says `privileged: true`."""
    options = {
        "hostname": ct.hostname,
        "cores": ct.cores,
        "memory": ct.memory_mib,
        "swap": ct.swap_mib,
        "rootfs": ct.rootfs,
        "net0": ct.net0,
        "onboot": int(ct.onboot),
        "unprivileged": int(not ct.privileged),  # root in the CT is not root on the host
    }
    if not ct.privileged:  # systemd's sandboxing (the engine unit's) needs it in such a CT
        options["features"] = "nesting=1"
    argv = ["pct", "create", str(ct.vmid), ct.ostemplate]
    for key, value in options.items():
        argv += [f"--{key}", str(value)]
    return argv


# -- recovery at boot --------------------------------------------------------------------------
def boot_specs(
    gpu_minors: tuple[int, ...], vmids: tuple[int, ...], pin_record: str
) -> list[TemplateSpec]:
    """The files that make a booted host recover its GPU CTs without a person: the recover unit
    runs the host's own ddops on the host's own site file (ops/chain/install.py); the kernel hook
    keeps a kernel whose NVIDIA build failed from booting next (`pin_record`: where the machine
    running the hook finds ops/host/kernels.py's PIN_RECORD)."""
    return [
        NvidiaModules(),
        GpuNodesUnit(gpu_minors=gpu_minors),
        RecoverUnit(vmids=vmids, ddops=HOST_DDOPS, inventory=HOST_SITE, env_file=HF_TOKEN_FILE),
        KernelHook(record=pin_record),
    ]


def _boot_changes(
    t: Transport, specs: list[TemplateSpec]
) -> tuple[list[tuple[TemplateSpec, str, str]], list[str]]:
    """(files to write as (spec, old, new), units to enable)."""
    files = []
    for spec in specs:
        new = render(spec)
        old = t.read_text(spec.INSTALL_PATH) if t.exists(spec.INSTALL_PATH) else ""
        if new != old:
            files.append((spec, old, new))
    units = [s.INSTALL_PATH.rsplit("/", 1)[1] for s in specs if s.INSTALL_PATH.endswith(".service")]
    return files, [u for u in units if not t.exists(f"{WANTS_DIR}/{u}")]


def boot_problems(t: Transport, specs: list[TemplateSpec]) -> list[str]:
    """What is missing or different among the boot files ([] when all are in place)."""
    files, disabled = _boot_changes(t, specs)
    problems = [
        f"{spec.INSTALL_PATH} {'differs' if old else 'is missing'}" for spec, old, _ in files
    ]
    return problems + [f"{unit} is not enabled" for unit in disabled]


def install_boot(t: Transport, specs: list[TemplateSpec], dry_run: bool) -> Outcome:
    """Write the boot files that differ (backed up) and enable the units; the diff either way."""
    files, disabled = _boot_changes(t, specs)
    diff = "".join(unified_diff(old, new, spec.INSTALL_PATH) for spec, old, new in files)
    actions = [f"write {spec.INSTALL_PATH}" for spec, _, _ in files]
    actions += [f"enable {u}" for u in disabled]
    if dry_run:
        return Outcome(True, "would " + ", ".join(actions), diff)
    for spec, _, new in files:
        t.write_file(spec.INSTALL_PATH, new, mode=spec.MODE)
    for unit in disabled:
        _enable(t, unit)
    if t.sysroot is None:  # a real host's systemd; a simulated one reads the files at boot
        t.run(["systemctl", "daemon-reload"]).check(t.label)
    return Outcome(True, ", ".join(actions), diff)


def _enable(t: Transport, unit: str) -> None:
    """What `systemctl enable` does for WantedBy=multi-user.target: a link in the wants dir."""
    wants = t.host_path(WANTS_DIR)
    t.run(["mkdir", "-p", wants]).check(t.label)
    t.run(["ln", "-sfn", f"../{unit}", f"{wants}/{unit}"]).check(t.label)


# -- the CT hookscript: nodes before every CT start, recovery after it ---------------------------
def hookscript(t: Transport, gpu_minors: tuple[int, ...]) -> Hookscript:
    """The hookscript for this host. Its paths are where the files live on the machine that runs
    it (a simulated host's own tools and ddops below its root)."""
    return Hookscript(
        nvidia_modprobe=t.host_path("/usr/bin/nvidia-modprobe"),
        gpu_minors=gpu_minors,
        ddops=t.host_path(HOST_DDOPS),
        inventory=t.host_path(HOST_SITE),
    )


def hookscript_problems(t: Transport, vmid: int, spec: Hookscript) -> tuple[list[str], str | None]:
    """(what is missing or stale, another hookscript the CT already has: ddops leaves it be)."""
    problems = []
    if not t.exists(spec.INSTALL_PATH) or t.read_text(spec.INSTALL_PATH) != render(spec):
        problems.append(f"{spec.INSTALL_PATH} is missing or stale")
    attached = ct_config(t, vmid).get("hookscript")
    if attached is None:
        problems.append(f"CT {vmid} has no hookscript")
    elif attached != spec.PVE_VOLUME:
        return problems, attached
    return problems, None


def install_hookscript(t: Transport, vmid: int, spec: Hookscript, dry_run: bool) -> Outcome:
    """Write the snippet (0755, backed up) and attach it (`pct set --hookscript`) where missing."""
    text, vmid = render(spec), validate_vmid(vmid)
    current = t.read_text(spec.INSTALL_PATH) if t.exists(spec.INSTALL_PATH) else ""
    diff = unified_diff(current, text, spec.INSTALL_PATH) if current != text else ""
    attach = ct_config(t, vmid).get("hookscript") is None
    actions = ([f"write {spec.INSTALL_PATH}"] if diff else []) + (
        [f"pct set {vmid} --hookscript {spec.PVE_VOLUME}"] if attach else []
    )
    if dry_run:
        return Outcome(bool(actions), "would " + ", ".join(actions), diff)
    if diff:
        t.write_file(spec.INSTALL_PATH, text, mode=0o755)
    if attach:
        t.run(["pct", "set", vmid, "--hookscript", spec.PVE_VOLUME]).check(f"CT {vmid}")
    return Outcome(bool(actions), ", ".join(actions), diff)


# -- capacity ----------------------------------------------------------------------------------
def model_config(ref: ModelRef, endpoint: str | None, token: str | None) -> dict:
    """A repo's config.json at the revision (one small file from the hub, cached)."""
    from huggingface_hub import hf_hub_download

    with hub_errors(ref):
        path = hf_hub_download(
            ref.repo, "config.json", revision=ref.revision, endpoint=endpoint, token=token
        )
    return json.loads(Path(path).read_text())


@dataclass(frozen=True)
class GpuFit:
    """The engine's memory plan (engine/memory_plan.py) held against the CT's smallest GPU."""

    problem: str | None
    evidence: str


def gpu_capacity(
    t: Transport, ct: ContainerSpec, model: ModelSpec, engine: EngineSpec, token: str | None
) -> GpuFit:
    """Whether the target and drafter, with the sequences serve plans (engine.max_num_seqs,
    engine.memory_plan.planned_sequences) of engine.max_model_len tokens at once, each a whole
    context or sharing a KV pool of engine.kv_cache_tokens, fit each GPU the CT's engine runs
    on (per rank)."""
    from engine.memory_plan import GIB, plan_from_configs, planned_sequences  # no torch

    memory = gpu_memory(t)
    missing = [gpu for gpu in ct.gpus if gpu not in memory]
    if missing:
        return GpuFit(f"{t.label}: nvidia-smi reports no memory for GPU {missing[0]}", "")
    gpu = min(ct.gpus, key=lambda g: memory[g])
    target = model_config(model.target, model.hub_endpoint, token)
    draft = model_config(model.draft, model.hub_endpoint, token) if model.draft else None
    _, dtype = engine_device_dtype(t, engine)
    sequences = planned_sequences(engine.max_num_seqs, engine.kv_cache_tokens, engine.tp) or 1
    pool = engine.kv_cache_tokens if engine.tp == 1 else None  # tensor parallel: one at a time
    plan = plan_from_configs(
        target, draft, dtype, memory[gpu], engine.max_model_len, engine.tp,
        sequences=sequences, kv_cache_tokens=pool,
    )  # fmt: skip
    where = f"CT {ct.vmid}: GPU {gpu} ({memory[gpu] / GIB:.1f} GiB, {dtype}, tp {engine.tp})"
    if plan.longest_fit < 1 and plan.pool_fits:  # a pool too large: problem() says so
        return GpuFit(
            f"{where}: {model.target.repo} does not fit: weights {plan.weights / GIB:.2f} GiB "
            f"+ state, transient and runtime {(plan.fixed_bytes - plan.weights) / GIB:.2f} GiB",
            "",
        )
    if problem := plan.problem():
        return GpuFit(f"{where}: {problem}{_max_num_seqs_hint(plan)}", "")
    context = plan.served_context
    return GpuFit(
        None,
        f"{where}: weights {plan.weights / GIB:.2f} GiB, {plan.bytes_per_token / 1024:.1f} KiB per "
        f"token, longest context {plan.longest_context} tokens; "
        f"{plan.sequences_fitting(context)} sequences of {context} tokens fit at once",
    )


def _max_num_seqs_hint(plan) -> str:
    """What to set when the context fits but not max_num_seqs sequences of it."""
    fitting = plan.sequences_fitting(plan.max_model_len)
    return f": set max_num_seqs to at most {fitting}" if 0 < fitting < plan.sequences else ""


def model_bytes(ref: ModelRef, endpoint: str | None, token: str | None) -> int:
    """The size of a repo's files at the revision, from the hub's file list (nothing downloaded)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    with hub_errors(ref):
        tree = HfApi(endpoint=endpoint, token=token).list_repo_tree(
            ref.repo, revision=ref.revision, recursive=True
        )
        return sum(entry.size for entry in tree if isinstance(entry, RepoFile))


def capacity_problem(
    ct: ContainerSpec, models: list[ModelRef], endpoint: str | None, token: str | None
) -> str | None:
    """Why the CT cannot hold the staged models plus the engine (None: it can)."""
    staged = sum(model_bytes(ref, endpoint, token) for ref in models)
    staged_mib = -(-staged // MIB)
    need_mib = staged_mib + ENGINE_RUNTIME_MIB
    if staged > ct.shm_gib << 30:
        return (
            f"CT {ct.vmid}: /dev/shm ({ct.shm_gib} GiB) cannot hold the model "
            f"({staged / 2**30:.2f} GiB): raise shm_gib"
        )
    if ct.memory_mib < need_mib:
        return (
            f"CT {ct.vmid}: memory {ct.memory_mib} MiB cannot hold the staged model "
            f"({staged_mib} MiB in /dev/shm) plus the engine (~{ENGINE_RUNTIME_MIB} MiB): "
            f"raise memory_mib to at least {need_mib}"
        )
    return None
