"""The project's shape: no import cycle, ops/ in layers (each importing only the ones below it) and
no cycle among engine/'s folders, the engine's runtime apart from its tools, no module sharing a
name with a package beside or above it, the READMEs' layouts matching the tree, one definition of
each shared name, the engine's torch-free modules (all ops may import of it) free of torch, and
the agents a CT runs bare on the standard library.

Imports are read from the source (every `import` and `from ... import`, at any depth of a file),
so an import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine import TORCH_FREE
from engine.methods import METHODS
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


# ops/, bottom up: a folder or top-level module (a unit) imports only units of the layers below
# its own. README's Layout lists the same order.
OPS_LAYERS = (
    ("ops", "ops.errors", "ops.diffs", "ops.resources"),
    ("ops.render",),
    ("ops.host",),
    ("ops.site",),
    ("ops.agents",),
    ("ops.results",),
    ("ops.chain",),
    ("ops.bench",),
    ("ops.ansible",),
    ("ops.demo_story",),
    ("ops.commands",),
    ("ops.cli",),
)
# The simulator, host's test double, stands beside the layers between `above` and `below`: it
# imports only layers up to `above`'s, and only layers from `below`'s up import it.
OPS_SIDE = {"ops.sim": ("ops.agents", "ops.demo_story")}


def unit_of(module: str) -> str:
    """The folder or top-level module of its package that `module` belongs to."""
    return ".".join(module.split(".")[:2])


def unit_graph(package: str) -> dict[str, set[str]]:
    """Which units of `package` import which (a unit's own imports of itself left out)."""
    graph: dict[str, set[str]] = {}
    for module, imported in import_graph().items():
        if module.split(".")[0] == package:
            unit = unit_of(module)
            graph.setdefault(unit, set()).update(unit_of(i) for i in imported if unit_of(i) != unit)
    return graph


def layer_spans() -> dict[str, tuple[float, float]]:
    """Each ops unit's (lowest, highest) layer: the same for a layer's units; a unit beside the
    layers spans the gap between the layers it stands on and the ones that use it."""
    spans = {unit: (float(i), float(i)) for i, layer in enumerate(OPS_LAYERS) for unit in layer}
    for unit, (above, below) in OPS_SIDE.items():
        spans[unit] = (spans[above][1] + 0.5, spans[below][0] - 0.5)
    return spans


def layering_offences(
    graph: dict[str, set[str]], spans: dict[str, tuple[float, float]]
) -> list[str]:
    """Each import of a unit that is not wholly below the importer, and each unit with no layer."""
    offences = [f"{unit} has no layer" for unit in sorted(graph.keys() - spans.keys())]
    for unit, imported in sorted(graph.items()):
        for other in sorted(imported & spans.keys()):
            if unit in spans and not spans[other][1] < spans[unit][0]:
                offences.append(f"{unit} imports {other}")
    return offences


def test_the_layering_check_finds_an_import_upwards_and_a_unit_without_a_layer():
    spans = {"low": (0, 0), "side": (0.5, 1.5), "mid": (1, 1), "top": (2, 2)}
    graph = {"low": {"mid"}, "mid": {"low", "side"}, "side": {"low"}, "top": {"side"}, "new": set()}
    assert layering_offences(graph, spans) == [
        "new has no layer",
        "low imports mid",
        "mid imports side",
    ]


def test_every_ops_unit_imports_only_the_layers_below_it():
    """Function-level imports count: a lazy import upwards is still an upward dependency."""
    offences = set(layering_offences(unit_graph("ops"), layer_spans()))
    assert not offences, "\n".join(sorted(offences))


def test_no_cycle_among_the_engines_folders():
    cycle = find_cycle(unit_graph("engine"))
    assert cycle is None, " imports ".join(cycle)


def readme_ops_layers() -> list[tuple[str, ...]]:
    """The layers README's Layout lists, bottom up: one numbered line each, its paths in
    backquotes before the colon (`host/` for ops.host, `cli.py` for ops.cli, `__init__.py` for
    ops itself)."""
    section = (REPO / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in section.splitlines():
        if match := re.match(r"\d+\. ((?:`[^`]+`(?:, )?)+):", line):
            names = (
                p.removesuffix("/").removesuffix(".py") for p in re.findall("`([^`]+)`", match[1])
            )
            layers.append(tuple("ops" if n == "__init__" else f"ops.{n}" for n in names))
    return layers


def test_the_readme_lists_the_layers_of_ops_in_order():
    assert readme_ops_layers() == list(OPS_LAYERS)


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


def readme_layout_paths(readme: str = "README.md") -> list[str]:
    """The paths of a README's Layout block: a line at column 0 names a top folder, an indented
    one a path inside the last top folder."""
    text = (REPO / readme).read_text()
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


@pytest.mark.parametrize("readme", ["README.md", "ops/README.md", "engine/README.md"])
def test_every_path_in_a_readme_layout_exists(readme):
    paths = readme_layout_paths(readme)
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
    names = set(METHODS)
    return {
        name
        for name, path in module_files().items()
        if name.split(".")[0] == package
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Tuple | ast.List | ast.Set)
        and {getattr(e, "value", None) for e in node.elts} == names
    }


def test_shared_names_are_defined_once():
    """The API key's variable and the list of decoding methods are spelt out in one module of
    the project: ops imports the engine's."""
    api_key = {
        module
        for package in PACKAGES
        for module, value in string_constants(package)
        if value == "DDOPS_API_KEY"
    }
    assert api_key == {"engine.server"}
    assert set().union(*map(method_lists, PACKAGES)) == {"engine.methods"}


def test_ops_imports_only_the_engines_torch_free_modules():
    """engine.TORCH_FREE names what ops may import of the engine (a host's ddops has no torch)."""
    offenders = {
        (module, imported)
        for module, imported_set in import_graph().items()
        if module.split(".")[0] == "ops"
        for imported in imported_set
        if imported.split(".")[0] == "engine" and imported not in TORCH_FREE
    }
    assert offenders == set()


def test_the_engines_torch_free_modules_load_no_torch():
    """Imported in a fresh interpreter, they load none of the engine's heavy libraries."""
    heavy = ("torch", "transformers", "triton")
    code = (
        f"import importlib, sys; [importlib.import_module(m) for m in {TORCH_FREE!r}]; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert done.stdout.strip() == "[]"


def test_the_staging_agent_starts_without_the_ssh_stack():
    """A boot's recover starts the staging agent in the CT three times: paramiko (0.1 s a start)
    is for opening SSH targets, which the agent never does."""
    code = "import sys, ops.agents.staging; print('paramiko' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert done.stdout.strip() == "False"


# Run in a CT by whatever python3 it has (from stdin or a pushed file): the standard library only.
STDLIB_AGENTS = ("ops.agents.probe", "ops.agents.engine_probe", "ops.agents.supervise")


@pytest.mark.parametrize("module", STDLIB_AGENTS)
def test_the_agents_a_ct_runs_bare_import_only_the_standard_library(module):
    tree = ast.parse(module_files()[module].read_text())
    imported = {
        alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names
    }
    imported |= {
        n.module
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module and not n.level
    }
    tops = {name.split(".")[0] for name in imported}
    assert tops - sys.stdlib_module_names == set()


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
