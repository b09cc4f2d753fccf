"""The sim's own tiny reader/writer of /etc/pve/lxc/<vmid>.conf (a Proxmox double: never ops.host.lxcconf).

Only the main section counts (lines before the first `[section]`); `key: value` lines, `#`
comments kept as they are. `set_keys` edits PVE keys in place and adds new ones before the raw `lxc.*`
lines of the main section, as `pct set` does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_KEY_LINE = re.compile(r"^([A-Za-z][\w.\-]*)\s*:\s?(.*)$")
_DEV_KEY = re.compile(r"^dev\d+$")


@dataclass(frozen=True)
class DevEntry:
    """One `devN: /dev/X[,gid=..,mode=..,uid=..]` entry."""

    key: str
    path: str
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None


def split_sections(text: str) -> tuple[list[str], list[str]]:
    """(main section lines, the rest starting at the first `[section]` header)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("["):
            return lines[:i], lines[i:]
    return lines, []


def entries(text: str) -> list[tuple[str, str]]:
    """(key, value) of every main-section line, in file order (repeated lxc.* keys included)."""
    main, _ = split_sections(text)
    return [(m.group(1), m.group(2).strip()) for line in main if (m := _KEY_LINE.match(line))]


def values(text: str) -> dict[str, str]:
    """The PVE keys of the main section (the last one wins)."""
    return dict(entries(text))


def dev_entries(text: str) -> list[DevEntry]:
    """The `devN:` entries, in file order."""
    found = []
    for key, value in entries(text):
        if _DEV_KEY.match(key):
            path, *props = value.split(",")
            opts = dict(p.split("=", 1) for p in props if "=" in p)
            found.append(
                DevEntry(
                    key,
                    opts.get("path", path),
                    int(opts["mode"], 8) if "mode" in opts else None,
                    int(opts["uid"]) if "uid" in opts else None,
                    int(opts["gid"]) if "gid" in opts else None,
                )
            )
    return found


def set_keys(text: str, updates: dict[str, str | None]) -> str:
    """Set (or delete, value None) PVE keys in the main section; other lines stay as they are."""
    main, rest = split_sections(text)
    pending = dict(updates)
    out = []
    for line in main:
        m = _KEY_LINE.match(line)
        if m and m.group(1) in pending:
            value = pending.pop(m.group(1))
            if value is not None:
                out.append(f"{m.group(1)}: {value}")
            continue
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    # New PVE keys go before the raw lxc.* block, where Proxmox writes them.
    raw_start = next((i for i, line in enumerate(out) if line.startswith("lxc.")), len(out))
    out[raw_start:raw_start] = [f"{k}: {v}" for k, v in pending.items() if v is not None]
    tail = [""] + rest if rest else []
    return "\n".join(out + tail) + "\n"
