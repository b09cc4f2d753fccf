"""A long measurement run section by section, each kept as soon as it ends.

A lent GPU machine's command is cut off at its time limit, and only the files it left come back:
a check that writes its report at the very end returns nothing when one section runs long or
raises. `run_sections` runs each section in turn and
- prints a line to stderr as each starts and ends (its seconds), so the output's tail says how
  far a cut-off run got;
- after each, hands the report to `save` (which writes it: `write_json`, atomically);
- records a section that raises under the report's `errors` (its last line there, the whole
  traceback on stderr), and runs the next ones;
- starts none once `deadline` seconds have passed since it began, and lists those under
  `skipped`, so a run that would pass its machine's limit stops between sections instead.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Section:
    """One part of a run: its name (its key in the report) and what measures it."""

    name: str
    run: Callable[[], object]


def run_sections(
    sections: list[Section],
    report: dict,
    save: Callable[[dict], None],
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict:
    """Each section's result as `report[name]`, in order (see the module docstring)."""
    started = clock()
    report.setdefault("errors", {})
    report.setdefault("skipped", [])
    for section in sections:
        if deadline is not None and clock() - started >= deadline:
            report["skipped"].append(section.name)
            _progress(f"{section.name}: not started, past the {deadline:g} s deadline")
            continue
        _progress(f"{section.name} ...")
        began = clock()
        try:
            report[section.name] = section.run()
        except Exception as error:  # a section's failure is its figure; the rest still run
            report["errors"][section.name] = f"{type(error).__name__}: {error}"
            traceback.print_exc(file=sys.stderr)
            _progress(f"{section.name}: raised after {clock() - began:.1f} s")
        else:
            _progress(f"{section.name}: done in {clock() - began:.1f} s")
        save(report)
    return report


def write_json(path: Path, report: dict) -> None:
    """`report` as JSON at `path`, whole or not at all (a run cut off mid-write leaves the last
    whole report)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, path)


def _progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)
