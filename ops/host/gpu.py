"""Host GPU facts, read through a Transport: device majors, /dev/nvidia* nodes, driver, modules.

    facts = gpu_facts(t)
    facts.majors.uvm            # the dynamic nvidia-uvm major from /proc/devices (e.g. 509)
    facts.node("/dev/nvidia-uvm")  # DeviceNode(kind="char", major=509, minor=0) or None
    facts.driver_version        # "550.90.07" from /proc/driver/nvidia/version, None unloaded
    history = read_major_history(t)   # {511: "nvidia-uvm", ...}: every major NVIDIA has held here
    record_majors(t, char_majors)     # adds today's NVIDIA majors to that history (atomic, backed up)

Each parser is a pure function of the text a host gives (tested on real-world samples in
tests/ops/host/test_gpu.py); the readers beside them only fetch that text. Remedy: `create_uvm_nodes`
runs `nvidia-modprobe -u -c=0`, which makes the uvm nodes the module load does not.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ops.host.lxcconf import NVIDIA_LXC_HOOK
from ops.host.transport import Result, Transport

# Names the nvidia driver registers in /proc/devices (older drivers say plain "nvidia").
NVIDIA_FRONTEND_NAMES = ("nvidia-frontend", "nvidia")
_DRIVER_VERSION = re.compile(
    r"^NVRM version:.*?Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)\s", re.M
)
_NODE_KINDS = {
    "character special file": "char",
    "block special file": "block",
    "directory": "dir",
    "symbolic link": "link",
}


# -- /proc/devices -----------------------------------------------------------------------------
@dataclass(frozen=True)
class NvidiaMajors:
    """Character device majors: `nvidia` is 195 on every host; uvm and caps are dynamic."""

    nvidia: int | None
    uvm: int | None
    caps: int | None


def parse_char_majors(proc_devices: str) -> dict[str, int]:
    """{name: major} from the "Character devices:" section of /proc/devices."""
    majors: dict[str, int] = {}
    in_char = False
    for line in proc_devices.splitlines():
        if line.endswith(":"):
            in_char = line == "Character devices:"
        elif in_char and (parts := line.split()) and len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


def nvidia_majors(proc_devices: str) -> NvidiaMajors:
    majors = parse_char_majors(proc_devices)
    frontend = next((majors[n] for n in NVIDIA_FRONTEND_NAMES if n in majors), None)
    return NvidiaMajors(frontend, majors.get("nvidia-uvm"), majors.get("nvidia-caps"))


def read_majors(t: Transport) -> NvidiaMajors:
    return nvidia_majors(t.read_text("/proc/devices"))


# -- the host's history of NVIDIA majors ---------------------------------------------------------
# A CT config rule for a major NVIDIA held once and holds no more grants whatever device takes that
# major next. Only the host can say which majors were NVIDIA's: provision and every recover (the
# boot unit's too) add today's to this file, so a rule added by hand for an old uvm major is known.
MAJOR_HISTORY = "/var/lib/ddops/nvidia-majors"
_HISTORY_HEADER = "# Majors NVIDIA drivers have held on this host (ddops: stale CT grants)\n"


def nvidia_char_majors(char_majors: dict[str, int]) -> dict[int, str]:
    """{major: driver name} of the NVIDIA drivers in a /proc/devices table."""
    return {major: name for name, major in char_majors.items() if name.startswith("nvidia")}


def parse_major_history(text: str) -> dict[int, str]:
    """{major: driver name} from the history file's `MAJOR NAME` lines (others are ignored)."""
    history = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].startswith("nvidia"):
            history.setdefault(int(parts[0]), parts[1])
    return history


def read_major_history(t: Transport) -> dict[int, str]:
    """Every major an NVIDIA driver has held on the host, as ddops recorded them ({} at first)."""
    return parse_major_history(t.read_text(MAJOR_HISTORY)) if t.exists(MAJOR_HISTORY) else {}


def _unrecorded(history: dict[int, str], char_majors: dict[str, int]) -> dict[int, str]:
    return {m: name for m, name in nvidia_char_majors(char_majors).items() if m not in history}


def unrecorded_majors(t: Transport, char_majors: dict[str, int]) -> dict[int, str]:
    """Today's NVIDIA majors the history does not name yet."""
    return _unrecorded(read_major_history(t), char_majors)


def record_majors(t: Transport, char_majors: dict[str, int]) -> dict[int, str]:
    """Add today's NVIDIA majors to the history (written atomically, the old one backed up);
    the majors added."""
    history = read_major_history(t)
    if new := _unrecorded(history, char_majors):
        merged = sorted({**history, **new}.items())
        t.write_file(MAJOR_HISTORY, _HISTORY_HEADER + "".join(f"{m} {n}\n" for m, n in merged))
    return new


# -- /dev/nvidia* ------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceNode:
    """A /dev/nvidia* entry: kind is "char", "block", "dir", "link" or "file"."""

    path: str
    kind: str
    major: int
    minor: int


def parse_stat_nodes(stat_output: str) -> list[DeviceNode]:
    """Parse `stat -c '%F %t %T %n'` lines (%t/%T: major/minor in hex), sorted by path."""
    nodes = []
    for line in stat_output.splitlines():
        if not line.strip():
            continue
        kind, major, minor, path = line.rsplit(" ", 3)
        nodes.append(
            DeviceNode(path, _NODE_KINDS.get(kind, "file"), int(major, 16), int(minor, 16))
        )
    return sorted(nodes, key=lambda n: n.path)


def list_nodes(t: Transport) -> list[DeviceNode]:
    """The host's /dev/nvidia* entries, and those in /dev/nvidia-caps/, as host paths."""
    dev = t.host_path("/dev")  # below the sysroot on a simulated host
    find = ["find", dev, "-mindepth", "1", "-maxdepth", "2", "-path", f"{dev}/nvidia*"]
    stat = ["-exec", "stat", "-c", "%F %t %T %n", "{}", "+"]
    nodes = parse_stat_nodes(t.run(find + stat).check(t.label).stdout)
    return [dataclasses.replace(n, path="/dev" + n.path.removeprefix(dev)) for n in nodes]


# -- driver and modules ------------------------------------------------------------------------
def parse_driver_version(text: str) -> str | None:
    """The kernel module version in /proc/driver/nvidia/version (proprietary or open module)."""
    match = _DRIVER_VERSION.search(text)
    return match[1] if match else None


def driver_version(t: Transport) -> str | None:
    """The loaded kernel module's version; None when no nvidia module is loaded."""
    try:
        return parse_driver_version(t.read_text("/proc/driver/nvidia/version"))
    except FileNotFoundError:
        return None


def parse_proc_modules(text: str) -> dict[str, str]:
    """{module: state} from /proc/modules ("nvidia_uvm 1794048 0 - Live 0x0 (POE)")."""
    modules = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 5:
            modules[fields[0]] = fields[4]
    return modules


def loaded_modules(t: Transport) -> dict[str, str]:
    return parse_proc_modules(t.read_text("/proc/modules"))


# -- all together ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuFacts:
    """What the host says about its NVIDIA GPUs, read in one go."""

    majors: NvidiaMajors
    nodes: tuple[DeviceNode, ...]
    driver_version: str | None
    modules: dict[str, str]  # the nvidia* kernel modules loaded: name -> state (Live, ...)

    def node(self, path: str) -> DeviceNode | None:
        return next((n for n in self.nodes if n.path == path), None)

    @property
    def gpu_paths(self) -> list[str]:
        """/dev/nvidia0, /dev/nvidia1, ... (one per GPU)."""
        return [n.path for n in self.nodes if re.fullmatch(r"/dev/nvidia\d+", n.path)]


def gpu_facts(t: Transport) -> GpuFacts:
    modules = {m: s for m, s in loaded_modules(t).items() if m.startswith("nvidia")}
    return GpuFacts(read_majors(t), tuple(list_nodes(t)), driver_version(t), modules)


def create_uvm_nodes(t: Transport) -> Result:
    """`nvidia-modprobe -u -c=0`: load nvidia_uvm and create /dev/nvidia-uvm{,-tools}."""
    return t.run(["nvidia-modprobe", "-u", "-c=0"]).check(t.label)


def gpu_memory(t: Transport) -> dict[int, int]:
    """Each GPU's total memory in bytes, by index (nvidia-smi); {} when nvidia-smi cannot tell."""
    r = t.run(["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"])
    if not r.ok:
        return {}
    memory = {}
    for line in r.stdout.splitlines():
        index, _, mib = line.partition(",")
        if index.strip().isdigit() and mib.strip().isdigit():
            memory[int(index)] = int(mib) << 20
    return memory


# -- the host's own driver userspace, for LXC's NVIDIA mount hook ------------------------------
NVIDIA_CONTAINER_CLI = "/usr/bin/nvidia-container-cli"  # libnvidia-container-tools
_NVML_LIBRARY = re.compile(r"NVML library version: (\d+(?:\.\d+)+)")


def host_userspace_mountable(t: Transport) -> bool:
    """Whether LXC's NVIDIA mount hook can give a CT the host's own userspace at each start: the
    hook ships with LXC, nvidia-container-cli with NVIDIA's libnvidia-container-tools."""
    return t.exists(NVIDIA_CONTAINER_CLI) and t.exists(NVIDIA_LXC_HOOK)


def host_userspace_version(t: Transport) -> str | None:
    """The host's own driver userspace (NVML) version: nvidia-smi's, or the one it names when it
    differs from the loaded module ("NVML library version: 590.48.02"); None when it cannot say."""
    r = t.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if r.ok and r.stdout.strip():
        return r.stdout.splitlines()[0].strip()
    match = _NVML_LIBRARY.search(r.stdout + r.stderr)
    return match[1] if match else None


# -- GPUs that need NVIDIA's open kernel module (Blackwell) -------------------------------------
OPEN_MODULE_FROM_CC = 10  # Blackwell (cc 10.x data centre, 12.x RTX PRO / RTX 50xx): open only
_LSPCI_NVIDIA = re.compile(r"NVIDIA Corporation [^\[]*\[([^\]]+)\] \[10de:")


def module_is_open(version_text: str) -> bool:
    """Whether /proc/driver/nvidia/version names the open kernel module."""
    return "Open Kernel Module" in version_text


def needs_open_module(name: str, compute_cap: str | None = None) -> bool:
    major = compute_cap.split(".")[0] if compute_cap else ""
    return "Blackwell" in name or (major.isdigit() and int(major) >= OPEN_MODULE_FROM_CC)


def gpu_models(t: Transport) -> list[tuple[str, str | None]]:
    """(name, compute capability) of each NVIDIA GPU: nvidia-smi's, else lspci's names (a GPU
    the loaded module cannot drive is not in nvidia-smi's list)."""
    r = t.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"])
    rows = [line.rsplit(",", 1) for line in r.stdout.splitlines() if "," in line] if r.ok else []
    if rows:
        return [(name.strip(), cc.strip()) for name, cc in rows]
    lspci = t.run(["lspci", "-nn", "-d", "10de:"])
    return [(m[1], None) for line in lspci.stdout.splitlines() if (m := _LSPCI_NVIDIA.search(line))]


def open_module_problem(t: Transport) -> str | None:
    """Why the loaded module cannot drive the host's GPUs (the proprietary flavour on a GPU that
    needs the open one); None when it can, or when no nvidia module is loaded."""
    try:
        text = t.read_text("/proc/driver/nvidia/version")
    except FileNotFoundError:
        return None
    if module_is_open(text):
        return None
    needing = [name for name, cc in gpu_models(t) if needs_open_module(name, cc)]
    if not needing:
        return None
    version = parse_driver_version(text) or "?"
    return (
        f"the proprietary nvidia module {version} is loaded, but {needing[0]} needs NVIDIA's open "
        f"kernel module (Blackwell): install the driver's open flavour (nvidia-open, or the .run "
        f"installer's -m=kernel-open; the open module is the default from 560) and reboot"
    )
