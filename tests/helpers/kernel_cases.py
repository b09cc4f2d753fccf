"""Shared by the kernel tests (Triton and batched vs the references): tree shapes, tolerances,
and running the Triton kernel modules in Triton's CPU interpreter.

Tolerances: float32 1e-5 (same maths, another summation order); bf16 inputs 1.6e-2 relative,
one or two bf16 rounding steps of the output (the interpreter rounds float32 to bf16 by
truncation, a GPU to nearest); float64 1e-12.

The interpreter must be on (TRITON_INTERPRET=1) both when a kernel is defined and when it runs.
`import_interpreted` imports a kernel module with it on (reloading one imported earlier without
it); a test module keeps it on while its tests run with `interpreter_for(modules)` as an autouse
fixture, which afterwards restores the environment and forgets those modules, so that later
imports compile for real.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from importlib.util import find_spec
from types import ModuleType

import torch

TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
    torch.float64: {"atol": 1e-12, "rtol": 1e-12},
}

TREE_SHAPES = {  # parents of each node; -1: the node hangs off the committed prefix
    "single": [-1],
    "all_roots": [-1, -1, -1, -1, -1],
    "chain": [-1, 0, 1, 2, 3, 4],
    "wide": [-1, 0, 0, 0, 0, 0, 0],
    "two_level": [-1, 0, 0, 1, 1, 2, 2],
    "forest": [-1, 0, -1, 2, 1, -1, 3],
}


@contextlib.contextmanager
def triton_interpreter() -> Iterator[None]:
    """TRITON_INTERPRET=1 inside the block, the previous value after it."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def import_interpreted(name: str) -> ModuleType:
    """The kernel module `name` with its kernels defined for the interpreter."""
    with triton_interpreter():
        module = sys.modules.get(name)
        return importlib.reload(module) if module else importlib.import_module(name)


def interpreter_for(modules: tuple[str, ...]) -> Iterator[None]:
    """Body of a module-scoped autouse fixture: the interpreter on for the module's tests, then
    `modules` forgotten so that later imports compile for real."""
    with triton_interpreter():
        yield
    for name in modules:
        sys.modules.pop(name, None)


def compiled_copy(name: str) -> ModuleType:
    """A private copy of kernel module `name` with its kernels defined for the compiler (as on
    a GPU), to inspect how they would specialise; nothing is compiled or run."""
    spec = importlib.util.spec_from_file_location(f"_compiled_{name}", find_spec(name).origin)
    module = importlib.util.module_from_spec(spec)
    previous = os.environ.pop("TRITON_INTERPRET", None)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
        if previous is not None:
            os.environ["TRITON_INTERPRET"] = previous
    return module
