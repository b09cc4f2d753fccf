"""The project's shape: no import cycle, the engine's runtime apart from its tools, no module
sharing a name with a package beside or above it, and the README's layout matching the tree.

Imports are read from the source (every `import` and `from ... import`, at any depth of a file),
so an import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import REPO

PACKAGES = ("ops", "engine")
# What the engine runs when it serves or generates; its tools (engine/tools) may import these,
# never the other way round.
ENGINE_RUNTIME = (
    "engine.models",
    "engine.kernels",
    "engine.server",
    "engine.decode",
    "engine.tree",
)


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (a `from package import module` names the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
    return found & modules.keys()


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a path that ends where it starts, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_among_the_projects_modules():
    assert find_cycle(import_graph()) is None


def test_no_runtime_engine_module_imports_a_tool():
    offenders = {
        (module, imported)
        for module, imported_set in import_graph().items()
        if module.startswith(ENGINE_RUNTIME)
        for imported in imported_set
        if imported.startswith("engine.tools")
    }
    assert not offenders


def test_no_module_shares_a_name_with_a_package_beside_or_above_it():
    """ops/recover.py (the chain's runner) beside ops/commands/recover.py (the command) was the
    confusion. A command module named after the package it drives (ops/commands/bench.py and
    ops/bench/) is no clash: one is a file, the other a folder."""
    clashes = []
    for package in PACKAGES:
        root = REPO / package
        for path in root.rglob("*.py"):
            if path.name == "__init__.py":
                continue
            for parent in path.parents:
                if parent == root.parent:
                    break
                twin = parent / path.name
                if twin != path and twin.exists():
                    clashes.append((path.relative_to(REPO), twin.relative_to(REPO)))
    assert not clashes


def readme_layout_paths() -> list[str]:
    """The paths of README's Layout block: a line at column 0 names a top folder, an indented
    one a path inside the last top folder."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    paths, top = [], ""
    for line in block.splitlines():
        if not line.strip():
            continue
        name = line.split()[0]
        top = name if not line.startswith(" ") else top
        paths.append(name if name == top else top + name)
    return paths


def test_every_path_in_the_readme_layout_exists():
    paths = readme_layout_paths()
    assert len(paths) > 20
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing


@pytest.mark.parametrize("package", ["ops", "engine"])
def test_every_subpackage_is_in_the_readme_layout(package):
    listed = set(readme_layout_paths())
    subpackages = [
        f"{p.parent.relative_to(REPO)}/"
        for p in (REPO / package).rglob("__init__.py")
        if p.parent != REPO / package
    ]
    assert [s for s in subpackages if s not in listed] == []


def string_constants(package: str) -> list[tuple[str, str]]:
    """(module, value) of every string constant in `package`'s code, docstrings aside."""
    found = []
    for name, path in module_files().items():
        if not name.startswith(package + ".") and name != package:
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        found += [
            (name, node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ]
    return found


def method_lists(package: str) -> set[str]:
    """The modules of `package` that spell out the list of decoding methods."""
    names = {"ar", "linear", "ddtree"}
    return {
        name
        for name, path in module_files().items()
        if name.split(".")[0] == package
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Tuple | ast.List | ast.Set)
        and {getattr(e, "value", None) for e in node.elts} == names
    }


@pytest.mark.parametrize("package", ["ops", "engine"])
def test_shared_names_are_defined_once_per_side(package):
    """The API key's variable and the list of decoding methods are spelt out in one module of
    each side."""
    api_key = {module for module, value in string_constants(package) if value == "DDOPS_API_KEY"}
    assert len(api_key) == 1, api_key
    assert len(method_lists(package)) == 1, method_lists(package)


def test_no_test_module_imports_another():
    """What tests share lives in tests/helpers or a conftest.py, not in another test module."""
    offenders = []
    for path in (REPO / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.split(".")[-1].startswith("test_")
            ):
                offenders.append((path.relative_to(REPO), node.module))
    assert not offenders
