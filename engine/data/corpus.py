"""The demo pair's data: the running interpreter's standard library, split into training and
held-out files, and the benchmark's prompts cut from the held-out ones.

engine/tools/train_demo.py trains on the first split; `python -m engine bench` and ddops' own
bench prompt with `held_out_prompts`, so the continuation is code the model never saw.
"""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

HELD_OUT_EVERY = 10  # file i (sorted) is held out when i % HELD_OUT_EVERY == 0


def stdlib_files(max_files: int | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) among the running interpreter's Lib/*.py."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:max_files]
    held_out = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == 0]
    train = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY != 0]
    return train, held_out


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def held_out_prompts(count: int, chars: int = 400) -> list[str]:
    """`count` Python prompts from held-out files: the code before a `def` line, that line included.

    Each prompt ends right after the signature of the first function defined past the middle
    of its file, so the continuation is a function body the model never trained on.
    """
    prompts = []
    for text in read_texts(stdlib_files()[1]):
        middle = len(text) // 2
        found = re.search(r"^ *def [^\n]*:\n", text[middle:], flags=re.MULTILINE)
        if found:
            end = middle + found.end()
            start = text.find("\n", max(0, end - chars), end) + 1  # a whole first line
            prompts.append(text[start:end])
        if len(prompts) == count:
            break
    return prompts
