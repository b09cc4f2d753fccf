"""Read and edit a Proxmox CT config (/etc/pve/lxc/<vmid>.conf), keeping every line ddops does not own.

    config = parse(text)                      # main section + [snapshot] / [pve:pending] sections
    config.text() == text                     # byte for byte, CRLF and a missing final newline too
    problems = find_problems(text)            # named problems with line numbers; validate() raises
    new = plan_gpu_block(text, GpuBlock(devices, style="devN", shm_size_gib=16), majors=host_majors)
    print(ops.diffs.unified_diff(text, new, "/etc/pve/lxc/200.conf"))  # for --dry-run
    report = find_stale_rules(text, {"nvidia-frontend": 195, "nvidia-uvm": 509}, history={511})

The file format (as Proxmox writes it): `#` lines on top are the description; `key: value` lines,
Proxmox keys first (sorted), raw `lxc.*` keys after them; then `[name]` sections (snapshots,
`[pve:pending]`) that hold whole copies of a config. ddops edits only the main section.

What ddops owns there, the GPU block:
  - `devN:` entries whose path is /dev/nvidia*;
  - `lxc.cgroup2.devices.allow` (and the wrong v1 spelling `lxc.cgroup.devices.allow`) rules for
    a char major an NVIDIA driver holds now (195, and e.g. nvidia-uvm's dynamic major), for a
    major ddops marked as its own when it wrote the rule, or for a major an NVIDIA driver held
    before (the host's major history, ops/host/gpu.py: a rule added by hand while 511 was the
    uvm major). Such a rule for a major no NVIDIA driver holds now is stale: it would grant the
    CT whatever device takes that major next, so it goes. A rule for a major that was never
    NVIDIA's is the user's (`c 240:* rwm`), whatever it looks like, and stays byte for byte;
  - the mark itself, one description line `#ddops owns devices.allow majors 195 509`. Proxmox
    keeps `#` lines as the CT's description (moved to the top, with `:` and non-printable
    characters %-encoded; the mark has none), so it survives `pct set`;
  - `lxc.mount.entry` lines that bind /dev/nvidia* or mount the CT's /dev/shm;
  - LXC's NVIDIA mount hook, `lxc.hook.mount: /usr/share/lxc/hooks/nvidia`, and its
    `lxc.environment: NVIDIA_VISIBLE_DEVICES=...` / `NVIDIA_DRIVER_CAPABILITIES=...` lines.
Everything else stays byte for byte and in place. The block ddops wants is rendered from
templates/ct-gpu.conf.j2, the template the playbooks render too.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum

from ops.errors import DdopsError
from ops.render import render_template

GPU_BLOCK_TEMPLATE = "ct-gpu.conf.j2"
NVIDIA_FRONTEND_MAJOR = 195  # /dev/nvidia0..N, /dev/nvidiactl, /dev/nvidia-modeset: fixed
DYNAMIC_CHAR_MAJORS = (range(234, 255), range(384, 512))  # where the kernel hands out majors
MAX_DEV_INDEX = 255
GPU_STYLES = ("devN", "raw")

ALLOW_KEY = "lxc.cgroup2.devices.allow"
ALLOW_KEY_V1 = "lxc.cgroup.devices.allow"
MOUNT_KEY = "lxc.mount.entry"
# LXC's NVIDIA mount hook (libnvidia-container on the host): the host's own driver userspace is
# mounted into the CT at each start, told which GPUs and what through these two variables.
HOOK_KEY, ENV_KEY = "lxc.hook.mount", "lxc.environment"
NVIDIA_LXC_HOOK = "/usr/share/lxc/hooks/nvidia"
NVIDIA_ENV = ("NVIDIA_VISIBLE_DEVICES=", "NVIDIA_DRIVER_CAPABILITIES=")

_LINES = re.compile(r"[^\n]*\n|[^\n]+$")
_HEADER = re.compile(r"\[(pve:pending|[a-z][a-z0-9_\-]+)\]\s*", re.IGNORECASE)
_LXC_ENTRY = re.compile(r"(lxc\.[a-z0-9_\-.]+)(?::|\s*=)\s*(.*?)\s*")
_PVE_ENTRY = re.compile(r"([a-z][a-z_]*\d*):\s*(\S.*?)\s*")
_DEV_KEY = re.compile(r"dev(\d+)")
_ALLOW_RULE = re.compile(
    r"(?P<type>[abc])(?:\s+(?P<major>\*|\d+):(?P<minor>\*|\d+))?(?:\s+[rwm]+)?"
)
_NVIDIA_PATH = re.compile(r"/dev/nvidia[A-Za-z0-9_\-/]*")
MARK_PREFIX = "#ddops owns devices.allow majors"
_MARK = re.compile(re.escape(MARK_PREFIX) + r"((?: \d{1,4})+)")


# -- the file model ------------------------------------------------------------------------------


class Kind(Enum):
    """What a line is, as Proxmox's parser reads it."""

    BLANK = "blank"
    COMMENT = "comment"
    HEADER = "header"
    ENTRY = "entry"
    MALFORMED = "malformed"


@dataclass(frozen=True)
class Line:
    """One line exactly as in the file (`raw` keeps its line ending), and what it says."""

    number: int  # 1-based, in the whole file
    raw: str
    kind: Kind
    key: str = ""
    value: str = ""

    @property
    def text(self) -> str:
        """The line without its line ending."""
        return _without_eol(self.raw)

    @property
    def is_lxc(self) -> bool:
        return self.key.startswith("lxc.")

    def normalised(self) -> tuple[str, str]:
        """(key, value) with runs of blanks collapsed: how two spellings of one entry compare
        (other lines: their text)."""
        if self.kind is not Kind.ENTRY:
            return "", self.text
        return self.key, " ".join(self.value.split())


def _without_eol(raw: str) -> str:
    return raw.removesuffix("\n").removesuffix("\r")


def parse_line(raw: str, number: int) -> Line:
    """Classify one line the way Proxmox's parser reads it."""
    text = _without_eol(raw)
    if not text.strip():
        return Line(number, raw, Kind.BLANK)
    if text.startswith("#"):
        return Line(number, raw, Kind.COMMENT)
    if header := _HEADER.fullmatch(text):
        return Line(number, raw, Kind.HEADER, key=header.group(1))
    if entry := _LXC_ENTRY.fullmatch(text) or _PVE_ENTRY.fullmatch(text):
        return Line(number, raw, Kind.ENTRY, key=entry.group(1), value=entry.group(2))
    return Line(number, raw, Kind.MALFORMED)


@dataclass(frozen=True)
class Section:
    """The main section (name None, no header) or one `[name]` section."""

    name: str | None
    header: Line | None
    lines: tuple[Line, ...]  # the body, header excluded

    def entries(self) -> list[Line]:
        return [line for line in self.lines if line.kind is Kind.ENTRY]

    def label(self) -> str:
        return "the main section" if self.name is None else f"section [{self.name}]"

    def raw(self) -> str:
        """The section's text, header included, byte for byte."""
        return (self.header.raw if self.header else "") + "".join(line.raw for line in self.lines)


@dataclass(frozen=True)
class CtConfig:
    """A parsed CT config: its sections in file order, the main section first."""

    sections: tuple[Section, ...]

    @property
    def main(self) -> Section:
        return self.sections[0]

    def section(self, name: str) -> Section | None:
        return next((s for s in self.sections if s.name == name), None)

    def text(self) -> str:
        """The file again, byte for byte."""
        return "".join(section.raw() for section in self.sections)


def parse(text: str) -> CtConfig:
    """Split a CT config into its sections, keeping every line exactly."""
    sections: list[Section] = []
    name: str | None = None
    header: Line | None = None
    body: list[Line] = []
    for number, raw in enumerate(_LINES.findall(text), start=1):
        line = parse_line(raw, number)
        if line.kind is Kind.HEADER:
            sections.append(Section(name, header, tuple(body)))
            name, header, body = line.key, line, []
        else:
            body.append(line)
    sections.append(Section(name, header, tuple(body)))
    return CtConfig(tuple(sections))


# -- validation ----------------------------------------------------------------------------------


class Problem(StrEnum):
    """The named problems `find_problems` reports."""

    MALFORMED_LINE = "malformed-line"
    DUPLICATE_DEV_INDEX = "duplicate-dev-index"
    DUPLICATE_KEY = "duplicate-key"
    DEV_INDEX_OUT_OF_RANGE = "dev-index-out-of-range"
    CGROUP_V1_KEY = "cgroup-v1-key"
    KEY_BELOW_SECTION = "key-below-section"


@dataclass(frozen=True)
class ConfigProblem:
    """One problem: which, on which line (1-based, in the whole file), in words."""

    problem: Problem
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message} [{self.problem}]"


class ConfigError(DdopsError):
    """A CT config has problems; `problems` lists them all, the message names the first."""

    def __init__(self, obj: str, problems: Sequence[ConfigProblem]) -> None:
        self.problems = tuple(problems)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(obj, f"{problems[0]}{more}", "\n".join(map(str, problems)))


def find_problems(text: str) -> list[ConfigProblem]:
    """Every problem in the config, in line order."""
    config = parse(text)
    problems = [p for section in config.sections for p in _section_problems(section)]
    return sorted(problems, key=lambda p: p.line)


def validate(text: str, obj: str = "CT config") -> CtConfig:
    """The parsed config, or ConfigError naming each problem and its line."""
    if problems := find_problems(text):
        raise ConfigError(obj, problems)
    return parse(text)


def _section_problems(section: Section) -> Iterable[ConfigProblem]:
    seen: dict[str, Line] = {}
    for line in section.lines:
        if line.kind is Kind.MALFORMED:
            yield ConfigProblem(
                Problem.MALFORMED_LINE,
                line.number,
                f"`{line.text.strip()}` is neither `key: value`, a `#` comment nor a `[section]` header",
            )
        if line.kind is not Kind.ENTRY:
            continue
        yield from _entry_problems(line, seen.get(line.key))
        seen.setdefault(line.key, line)
    if section.name is not None:
        yield from _order_problems(section)


def _entry_problems(line: Line, earlier: Line | None) -> Iterable[ConfigProblem]:
    if dev := _DEV_KEY.fullmatch(line.key):
        if int(dev.group(1)) > MAX_DEV_INDEX:
            yield ConfigProblem(
                Problem.DEV_INDEX_OUT_OF_RANGE,
                line.number,
                f"{line.key}: devN index must be 0..{MAX_DEV_INDEX}",
            )
        if earlier:
            yield ConfigProblem(
                Problem.DUPLICATE_DEV_INDEX,
                line.number,
                f"duplicate devN index {dev.group(1)}: {line.key} is already set at line {earlier.number}",
            )
    elif earlier and not line.is_lxc:
        yield ConfigProblem(
            Problem.DUPLICATE_KEY,
            line.number,
            f"duplicate key {line.key}: already set at line {earlier.number}",
        )
    if line.key.startswith("lxc.cgroup."):
        yield ConfigProblem(
            Problem.CGROUP_V1_KEY,
            line.number,
            f"{line.key} is the cgroup v1 spelling, ignored on PVE 7+: use "
            f"{line.key.replace('lxc.cgroup.', 'lxc.cgroup2.', 1)}",
        )


def cgroup_v1_lines(text: str) -> list[Line]:
    """The main section's `lxc.cgroup.*` lines (cgroup v1 keys; a snapshot's are not applied)."""
    return [line for line in parse(text).main.entries() if line.key.startswith("lxc.cgroup.")]


def _order_problems(section: Section) -> Iterable[ConfigProblem]:
    """Proxmox writes each section as sorted keys, then lxc.* keys. A line that breaks that
    order below a header was appended by hand or by a tool, most likely meant for the main
    section (appending to the file lands it in the last section)."""
    previous: Line | None = None
    for line in section.entries():
        if previous and not line.is_lxc and (previous.is_lxc or line.key < previous.key):
            yield ConfigProblem(
                Problem.KEY_BELOW_SECTION,
                line.number,
                f"{line.key} below {section.label()} (line {section.header.number}) breaks the "
                f"order Proxmox writes: a main-section line appended after the section header?",
            )
        previous = line


# -- what ddops owns -----------------------------------------------------------------------------


def _dev_path(value: str) -> str:
    """The node path of a devN value: `path=/dev/x,...` or the leading positional `/dev/x,...`."""
    for prop in value.split(","):
        name, sep, val = prop.partition("=")
        if not sep:
            return name.strip()
        if name.strip() == "path":
            return val.strip()
    return ""


def _allow_major(value: str) -> int | None:
    """The major a char-device allow rule names (`c 195:* rwm` -> 195); None for other rules."""
    rule = _ALLOW_RULE.fullmatch(value.strip())
    if rule and rule["type"] == "c" and rule["major"] not in (None, "*"):
        return int(rule["major"])
    return None


def _allows(value: str, major: int) -> bool:
    """Whether an allow rule grants char devices of this major (`a`, `c *:*`, `c MAJ:...`)."""
    rule = _ALLOW_RULE.fullmatch(value.strip())
    if not rule:
        return False
    return rule["type"] == "a" or (rule["type"] == "c" and rule["major"] in ("*", str(major)))


def _is_gpu_mount(value: str) -> bool:
    """`/dev/nvidia* dev/... none bind,...` or anything mounted on the CT's dev/shm."""
    source, target = ([*value.split(), "", ""])[:2]
    return source.startswith("/dev/nvidia") or target.strip("/") == "dev/shm"


def _mark_majors(line: Line) -> frozenset[int] | None:
    """The majors a ddops mark line names; None for any other line."""
    mark = _MARK.fullmatch(line.text) if line.kind is Kind.COMMENT else None
    return frozenset(map(int, mark.group(1).split())) if mark else None


def _mark_line(majors: Iterable[int]) -> str:
    return f"{MARK_PREFIX} {' '.join(map(str, sorted(set(majors))))}"


@dataclass(frozen=True)
class _Owner:
    """Decides which main-section lines belong to ddops' GPU block."""

    nvidia_majors: frozenset[int]  # majors NVIDIA drivers hold now (or the block grants)
    were_nvidia: frozenset[int]  # majors ddops marked, and those the host's history names
    known: bool  # whether the host's majors now were given (else nothing is called stale)

    @classmethod
    def for_config(
        cls,
        section: Section,
        majors: Mapping[str, int] | None,
        extra: Iterable[int] = (),
        history: Iterable[int] = (),
    ) -> _Owner:
        nvidia = {NVIDIA_FRONTEND_MAJOR, *extra}
        if majors is not None:
            nvidia |= {m for name, m in majors.items() if name.startswith("nvidia")}
        marked = frozenset().union(*(m for line in section.lines if (m := _mark_majors(line))))
        return cls(frozenset(nvidia), marked | frozenset(history), majors is not None)

    def is_stale(self, major: int) -> bool:
        """A rule for a major that was NVIDIA's (ddops marked it, or the host's history names
        it) and no NVIDIA driver holds now: the uvm major moved."""
        return self.known and major in self.were_nvidia and major not in self.nvidia_majors

    def owns(self, line: Line) -> bool:
        if _mark_majors(line) is not None:
            return True
        if line.kind is not Kind.ENTRY:
            return False
        if _DEV_KEY.fullmatch(line.key):
            return _dev_path(line.value).startswith("/dev/nvidia")
        if line.key in (ALLOW_KEY, ALLOW_KEY_V1):
            major = _allow_major(line.value)
            return major is not None and (major in self.nvidia_majors or self.is_stale(major))
        if line.key == MOUNT_KEY:
            return _is_gpu_mount(line.value)
        if line.key == HOOK_KEY:
            return line.value.strip() == NVIDIA_LXC_HOOK
        if line.key == ENV_KEY:
            return line.value.strip().startswith(NVIDIA_ENV)
        return False

    def owned(self, section: Section) -> list[Line]:
        return [line for line in section.lines if self.owns(line)]


# -- the desired block and the edit --------------------------------------------------------------


@dataclass(frozen=True)
class GpuDevice:
    """One device node the CT gets: its host path, major:minor now, and group inside the CT."""

    path: str
    major: int
    minor: int
    gid: int | None = None

    def __post_init__(self) -> None:
        if not _NVIDIA_PATH.fullmatch(self.path):
            raise DdopsError(self.path, "a GPU device path must be /dev/nvidia*")
        if not (0 <= self.major < 4096 and 0 <= self.minor < 1 << 20):
            raise DdopsError(self.path, f"no such device number {self.major}:{self.minor}")
        if self.gid is not None and self.gid < 0:
            raise DdopsError(self.path, f"gid must be >= 0, got {self.gid}")


@dataclass(frozen=True)
class GpuBlock:
    """The GPU block ddops wants in a CT config.

    style "devN" (PVE >= 8.1: Proxmox grants each node's current major at every start) or
    "raw" (cgroup2 allow + bind-mount lines; the majors are those of `devices`, read now);
    shm_size_gib: an explicit /dev/shm tmpfs size, or None for none;
    host_userspace: LXC's NVIDIA mount hook gives the CT the host's own driver userspace at each
    start (so it always matches the host's module), for the GPUs among `devices`.
    """

    devices: tuple[GpuDevice, ...]
    style: str = "devN"
    shm_size_gib: int | None = None
    host_userspace: bool = False

    def __post_init__(self) -> None:
        if self.style not in GPU_STYLES:
            raise DdopsError("GPU block", f"style must be one of {', '.join(GPU_STYLES)}")
        paths = [d.path for d in self.devices]
        if len(set(paths)) != len(paths):
            raise DdopsError("GPU block", f"a device is listed twice: {paths}")
        if self.shm_size_gib is not None and self.shm_size_gib < 1:
            raise DdopsError("GPU block", f"shm_size_gib must be >= 1, got {self.shm_size_gib}")

    def variables(self, indices: Sequence[int | None]) -> dict:
        """The template's variables, with each device's devN index (None in raw style)."""
        return {
            "style": self.style,
            "devices": [
                {"index": i, "path": d.path, "major": d.major, "minor": d.minor, "gid": d.gid}
                for d, i in zip(self.devices, indices, strict=True)
            ],
            "shm_size_gib": self.shm_size_gib,
            "host_userspace": self.host_userspace,
            "visible_devices": ",".join(
                d.path.removeprefix("/dev/nvidia")
                for d in self.devices
                if re.fullmatch(r"/dev/nvidia\d+", d.path)
            ),
        }


def _dev_index(line: Line) -> int | None:
    match = _DEV_KEY.fullmatch(line.key) if line.kind is Kind.ENTRY else None
    return int(match.group(1)) if match else None


def _assign_dev_indices(config: CtConfig, owned: Sequence[Line], desired: GpuBlock) -> list[int]:
    """One devN index per desired device: its current one where it has one, else the lowest free.

    Taken are the indices of the other devN entries of the main section and those pending in
    [pve:pending] (they become main-section entries when Proxmox applies them).
    """
    pending = config.section("pve:pending")
    owned_set = set(owned)
    others = [line for line in config.main.entries() if line not in owned_set]
    taken = {
        i
        for line in others + (pending.entries() if pending else [])
        if (i := _dev_index(line)) is not None
    }
    current: dict[str, int] = {}
    for line in owned:
        index = _dev_index(line)
        if index is not None and index <= MAX_DEV_INDEX and index not in taken:
            current.setdefault(_dev_path(line.value), index)
    indices: dict[str, int] = {}
    for device in desired.devices:  # keep the current indices first ...
        index = current.get(device.path)
        if index is not None and index not in indices.values():
            indices[device.path] = index
    free = (i for i in range(MAX_DEV_INDEX + 1) if i not in taken | set(indices.values()))
    for device in desired.devices:  # ... then give the others the lowest free ones
        if device.path not in indices:
            index = next(free, None)
            if index is None:
                raise DdopsError(
                    "CT config", f"no free devN index (0..{MAX_DEV_INDEX}) for {device.path}"
                )
            indices[device.path] = index
    return [indices[d.path] for d in desired.devices]


def render_gpu_block(desired: GpuBlock, indices: Sequence[int | None]) -> list[Line]:
    """The block's lines from templates/ct-gpu.conf.j2, parsed."""
    text = render_template(GPU_BLOCK_TEMPLATE, desired.variables(indices))
    return [parse_line(raw, 0) for raw in _LINES.findall(text)]


def _dev_insert_at(lines: Sequence[Line]) -> int:
    """Where new devN entries go when none is owned yet: beside the other devN entries, else at
    their sorted place among the Proxmox keys (as Proxmox writes them), else before the lxc.* keys."""
    entries = [(i, line) for i, line in enumerate(lines) if line.kind is Kind.ENTRY]
    devs = [i for i, line in entries if _DEV_KEY.fullmatch(line.key)]
    if devs:
        return devs[-1] + 1
    later = [i for i, line in entries if line.is_lxc or line.key > "dev"]
    return later[0] if later else _raw_insert_at(lines)


def _raw_insert_at(lines: Sequence[Line]) -> int:
    """Where new lxc.* lines go when none is owned yet: after the main section's last line that
    is not blank (its last lxc.* key, as Proxmox writes them), so blank lines before the first
    section header stay below."""
    filled = [i for i, line in enumerate(lines) if line.kind is not Kind.BLANK]
    return filled[-1] + 1 if filled else 0


def _mark_insert_at(lines: Sequence[Line]) -> int:
    """Where a new mark goes: after the description (the `#` lines on top), where Proxmox
    writes it."""
    return next((i for i, line in enumerate(lines) if line.kind is not Kind.COMMENT), len(lines))


def _group(line: Line) -> str:
    """Lines that may take each other's place: devN entries, allow rules (either spelling), mounts,
    the mark."""
    if line.kind is Kind.COMMENT:
        return "#"
    if _DEV_KEY.fullmatch(line.key):
        return "devN"
    return ALLOW_KEY if line.key == ALLOW_KEY_V1 else line.key


def _splice(
    lines: Sequence[Line], owned: Sequence[Line], block: Sequence[Line], eol: str
) -> list[str] | None:
    """The main section's lines with the owned ones turned into `block` by the smallest edit, or
    None when the block is already there (in any order).

    An owned line equal to a block line stays as it is (bytes and place). A block line not
    there yet takes the place of a removed owned line of its group (the stale `c 511:* rwm`
    becomes `c 509:* rwm` where it stood), else goes after the last owned line of its group,
    else where Proxmox would write it. Nothing goes below a section header: `lines` is the
    main section.
    """
    remaining = Counter(b.normalised() for b in block)
    kept: set[Line] = set()
    for line in owned:
        if remaining[line.normalised()] > 0:
            remaining[line.normalised()] -= 1
            kept.add(line)
    missing = []
    for line in block:
        if remaining[line.normalised()] > 0:
            remaining[line.normalised()] -= 1
            missing.append(line)
    removed = [line for line in owned if line not in kept]
    if not missing and not removed:
        return None
    position = {line: i for i, line in enumerate(lines)}
    after_group = {_group(line): position[line] + 1 for line in owned}  # file order: the last wins
    free_slots = list(removed)
    inserts: dict[int, list[str]] = defaultdict(list)
    for line in missing:
        group = _group(line)
        slot = next((s for s in free_slots if _group(s) == group), None)
        if slot is not None:
            free_slots.remove(slot)
            at = position[slot]
        elif group in after_group:
            at = after_group[group]
        elif group == "#":
            at = _mark_insert_at(lines)
        else:
            at = _dev_insert_at(lines) if group == "devN" else _raw_insert_at(lines)
        inserts[at].append(line.text + eol)
    gone = set(removed)
    out: list[str] = []
    for i, line in enumerate(lines):
        out.extend(inserts.get(i, []))
        if line not in gone:
            out.append(line.raw)
    out.extend(inserts.get(len(lines), []))
    return out


def _terminate(raws: list[str], eol: str, ends_open: bool) -> str:
    """Join lines, giving a line ending to any line that is no longer the last, and keeping the
    input's final-newline state (a file without one stays without one)."""
    out = [raw if raw.endswith("\n") else raw + eol for raw in raws]
    if out and ends_open:
        last = out[-1]
        out[-1] = last[: -len(eol)] if last.endswith(eol) else last.rstrip("\n")
    return "".join(out)


def plan_gpu_block(
    config_text: str,
    desired: GpuBlock,
    majors: Mapping[str, int] | None = None,
    history: Iterable[int] = (),
) -> str:
    """The config with its GPU block set to `desired`; every other line byte for byte and in place.

    majors: the host's char majors now, from /proc/devices (name -> major, at least the nvidia
    ones); history: every major an NVIDIA driver has held on the host. With the majors now, allow
    rules for a major that was NVIDIA's (marked by ddops, or in the history) and is no longer
    (the uvm major moved) are recognised as stale and removed; without, they are left alone, as
    is every rule for a major that never was NVIDIA's. Raw rules are written with their mark. A config
    whose GPU rules already are `desired` (in any order) is returned unchanged, mark or not
    (adding only a mark is not worth a CT restart). Problems
    in lines ddops does not own (see find_problems) are left for the caller to report.
    """
    config = parse(config_text)
    owner = _Owner.for_config(config.main, majors, (d.major for d in desired.devices), history)
    owned = owner.owned(config.main)
    indices = (
        _assign_dev_indices(config, owned, desired)
        if desired.style == "devN"
        else [None] * len(desired.devices)
    )
    block = render_gpu_block(desired, indices)
    if foreign := [b.text for b in block if not owner.owns(b)]:
        raise DdopsError(GPU_BLOCK_TEMPLATE, f"renders lines ddops would not own: {foreign}")
    eol = "\r\n" if config_text.split("\n", 1)[0].endswith("\r") else "\n"
    marks = [line for line in owned if line.kind is Kind.COMMENT]
    rules = [line for line in owned if line.kind is not Kind.COMMENT]
    if _splice(config.main.lines, rules, block, eol) is None:
        return config_text
    if rule_majors := [m for b in block if b.key == ALLOW_KEY and (m := _allow_major(b.value))]:
        block.append(parse_line(_mark_line(rule_majors), 0))
    main = _splice(config.main.lines, rules + marks, block, eol)
    rest = [section.raw() for section in config.sections[1:]]
    ends_open = bool(config_text) and not config_text.endswith("\n")
    return _terminate(main + rest, eol, ends_open)


# -- stale rules: evidence for the recover chain -------------------------------------------------

# The nodes CUDA opens, by the /proc/devices name of their driver (195 is the frontend's).
_NODE_FAMILIES = {
    "nvidia-frontend": ("/dev/nvidia*", re.compile(r"/dev/nvidia(\d+|ctl|-modeset)")),
    "nvidia-uvm": ("/dev/nvidia-uvm", re.compile(r"/dev/nvidia-uvm(-tools)?")),
}


@dataclass(frozen=True)
class Ungranted:
    """A node CUDA needs (e.g. /dev/nvidia-uvm) whose major now (e.g. 509) nothing grants."""

    node: str
    major: int


@dataclass(frozen=True)
class GrantReport:
    """Whether the CT config grants the majors the host's NVIDIA nodes have now."""

    ungranted: tuple[Ungranted, ...]  # nodes CUDA needs whose current major nothing grants
    stale: tuple[Line, ...]  # allow rules for a dynamic major no driver holds now
    v1_rules: tuple[Line, ...]  # GPU rules in the v1 spelling, which PVE 7+ ignores

    @property
    def ok(self) -> bool:
        return not (self.ungranted or self.stale or self.v1_rules)

    def evidence(self) -> list[str]:
        """One sentence per finding, e.g. `/dev/nvidia-uvm major 509 is not allowed by the CT
        config (allows 511)`; the caller prefixes the CT."""
        stale_majors = sorted({m for line in self.stale if (m := _allow_major(line.value))})
        allows = f" (allows {', '.join(map(str, stale_majors))})" if stale_majors else ""
        return [
            *(
                f"{u.node} major {u.major} is not allowed by the CT config{allows}"
                for u in self.ungranted
            ),
            *(
                f"line {s.number}: `{s.text}` is a stale grant (major {_allow_major(s.value)} was "
                "NVIDIA's, no NVIDIA driver holds it now)"
                for s in self.stale
            ),
            *(
                f"line {v.number}: `{v.text}` uses the cgroup v1 spelling, ignored on PVE 7+"
                for v in self.v1_rules
            ),
        ]


def find_stale_rules(
    config_text: str, majors: Mapping[str, int], history: Iterable[int] = ()
) -> GrantReport:
    """Compare the main section's GPU rules with the host's char majors now (from /proc/devices:
    name -> major, e.g. {"nvidia-frontend": 195, "nvidia-uvm": 509}; pass the whole table so
    other drivers' dynamic majors are not mistaken for stale ones) and with `history`, every
    major an NVIDIA driver has held on the host (ops/host/gpu.py).

    A node is granted by a devN entry for it (Proxmox grants its current major at start) or by a
    cgroup2 allow rule for its major; v1-spelled rules grant nothing on PVE 7+.
    """
    main = parse(config_text).main
    owner = _Owner.for_config(main, majors, history=history)
    entries = main.entries()
    required = [("nvidia-frontend", NVIDIA_FRONTEND_MAJOR)]
    if "nvidia-uvm" in majors:
        required.append(("nvidia-uvm", majors["nvidia-uvm"]))
    ungranted = []
    for family, major in required:
        node, pattern = _NODE_FAMILIES[family]
        by_dev = any(
            _DEV_KEY.fullmatch(e.key) and pattern.fullmatch(_dev_path(e.value)) for e in entries
        )
        by_rule = any(e.key == ALLOW_KEY and _allows(e.value, major) for e in entries)
        if not (by_dev or by_rule):
            ungranted.append(Ungranted(node, major))
    rules = [e for e in entries if e.key in (ALLOW_KEY, ALLOW_KEY_V1) and owner.owns(e)]
    stale = [r for r in rules if owner.is_stale(_allow_major(r.value))]
    return GrantReport(
        ungranted=tuple(ungranted),
        stale=tuple(stale),
        v1_rules=tuple(r for r in rules if r.key == ALLOW_KEY_V1),
    )
