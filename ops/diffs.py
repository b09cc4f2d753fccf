"""The one diff of a planned file change, as --dry-run shows it.

unified_diff(old_text, new_text, "/etc/pve/lxc/200.conf")   # "" when nothing changes
unified_diff(None, new_text, "CT 200:/etc/ddops/ddops-engine.service")  # a new file
"""

from __future__ import annotations

import difflib
import re

_LINES = re.compile(r"[^\n]*\n|[^\n]+$")  # every line, the last one without its newline too


def unified_diff(old: str | None, new: str, path: str) -> str:
    """A unified diff of a planned edit ("" when nothing changes): `old` None is a file that does
    not exist yet (from /dev/null); a missing final newline is marked as diff(1) marks it."""
    diff = difflib.unified_diff(
        _LINES.findall(old or ""),
        _LINES.findall(new),
        fromfile=path if old is not None else "/dev/null",
        tofile=f"{path} (planned)",
    )
    return "".join(
        line if line.endswith("\n") else f"{line}\n\\ No newline at end of file\n" for line in diff
    )
