"""The Ansible modules (the ddops_chain role's library/) document themselves as the collections' modules do.

Each module has DOCUMENTATION, EXAMPLES and RETURN (YAML, in the form of community.general's and
community.proxmox's modules); its documented options are exactly its argument_spec (the
module-level ARGUMENT_SPEC that its AnsibleModule gets), its attributes say how it behaves in
check mode, its examples are tasks that call it, and `ansible-doc` renders it without an error.

Nothing here runs a module or imports ops: the docs are read from the source (ast), and a module
file is imported only to read its ARGUMENT_SPEC, with its module_utils (the role's module_utils/)
loaded from the repository.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO

ROLE = REPO / "playbooks" / "roles" / "ddops_chain"
LIBRARY = ROLE / "library"
MODULE_UTILS = ROLE / "module_utils"
MODULES = sorted(path.stem for path in LIBRARY.glob("*.py") if not path.name.startswith("_"))
DOC_STRINGS = ("DOCUMENTATION", "EXAMPLES", "RETURN")
# What a module's option may say in DOCUMENTATION (ansible-test's validate-modules schema).
OPTION_KEYS = {
    "description",
    "type",
    "required",
    "default",
    "elements",
    "choices",
    "aliases",
    "version_added",
    "suboptions",
}
SUPPORT = ("full", "partial", "none")
# Keys every module result may carry without documenting them (Ansible's common return values).
COMMON_RETURN = {"changed", "failed"}


def doc_strings(path: Path) -> dict[str, str]:
    """DOCUMENTATION, EXAMPLES and RETURN of a module file, read from its source."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in DOC_STRINGS:
                assert isinstance(node.value, ast.Constant) and isinstance(node.value.value, str), (
                    f"{path.name}: {target.id} must be a plain string"
                )
                found[target.id] = node.value.value
    missing = [name for name in DOC_STRINGS if name not in found]
    assert not missing, f"{path.name} has no {', '.join(missing)}"
    return found


def documented(name: str) -> tuple[dict, list, dict]:
    """(DOCUMENTATION, EXAMPLES, RETURN) of module `name`, parsed as YAML."""
    strings = doc_strings(LIBRARY / f"{name}.py")
    parsed = {key: yaml.safe_load(text) for key, text in strings.items()}
    assert isinstance(parsed["DOCUMENTATION"], dict), f"{name}: DOCUMENTATION is not a mapping"
    assert isinstance(parsed["EXAMPLES"], list), f"{name}: EXAMPLES is not a list of tasks"
    assert isinstance(parsed["RETURN"], dict), f"{name}: RETURN is not a mapping"
    return parsed["DOCUMENTATION"], parsed["EXAMPLES"], parsed["RETURN"]


def _ops_modules() -> set[str]:
    return {m for m in sys.modules if m == "ops" or m.startswith("ops.")}


def argument_spec(name: str, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The module's ARGUMENT_SPEC, from importing its file (its main() does not run)."""
    utils = {}
    for path in MODULE_UTILS.glob("*.py"):
        spec = importlib.util.spec_from_file_location(f"ansible.module_utils.{path.stem}", path)
        utils[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(utils[spec.name])
    for util_name, util in utils.items():
        monkeypatch.setitem(sys.modules, util_name, util)
    before = _ops_modules()
    spec = importlib.util.spec_from_file_location(
        f"_ddops_module_doc_{name}", LIBRARY / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert _ops_modules() == before, f"importing {name} imported ops: keep ops imports in functions"
    assert isinstance(getattr(module, "ARGUMENT_SPEC", None), dict), f"{name} has no ARGUMENT_SPEC"
    return module.ARGUMENT_SPEC


def ansible_module_calls(name: str) -> list[ast.Call]:
    tree = ast.parse((LIBRARY / f"{name}.py").read_text())
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "AnsibleModule"
    ]


def keyword(call: ast.Call, arg: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == arg), None)


def test_the_library_has_the_modules():
    assert {"ddops_bench", "ddops_boot_files", "ddops_check"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_documentation_examples_and_return_are_yaml(name):
    assert ast.get_docstring(ast.parse((LIBRARY / f"{name}.py").read_text())), (
        f"{name}: keep the module's docstring"
    )
    doc, examples, returns = documented(name)
    assert doc["module"] == name
    for key in ("short_description", "version_added", "description", "options", "author"):
        assert doc.get(key), f"{name}: DOCUMENTATION has no {key}"
    assert examples, f"{name}: EXAMPLES has no task"
    assert returns, f"{name}: RETURN documents nothing"


@pytest.mark.parametrize("name", MODULES)
def test_documented_options_are_the_argument_spec(name, monkeypatch):
    (call,) = ansible_module_calls(name)
    passed = keyword(call, "argument_spec")
    assert isinstance(passed, ast.Name) and passed.id == "ARGUMENT_SPEC", (
        f"{name}: AnsibleModule(argument_spec=ARGUMENT_SPEC, ...), so the docs can be checked"
    )
    spec = argument_spec(name, monkeypatch)
    options = documented(name)[0]["options"]
    assert sorted(options) == sorted(spec)
    for option, arg in spec.items():
        doc = options[option]
        where = f"{name}: option {option}"
        assert set(doc) <= OPTION_KEYS, f"{where}: unknown keys {set(doc) - OPTION_KEYS}"
        assert doc.get("description"), f"{where}: no description"
        assert doc.get("type", "str") == arg.get("type", "str"), f"{where}: type"
        assert doc.get("required", False) == arg.get("required", False), f"{where}: required"
        assert doc.get("default") == arg.get("default"), f"{where}: default"
        assert doc.get("elements") == arg.get("elements"), f"{where}: elements"
        assert doc.get("choices") == arg.get("choices"), f"{where}: choices"
        assert doc.get("aliases", []) == arg.get("aliases", []), f"{where}: aliases"
        # A module's option docs have no no_log key (validate-modules' schema): a secret says so.
        description = (
            " ".join(doc["description"])
            if isinstance(doc["description"], list)
            else doc["description"]
        )
        assert ("no_log" in description) == arg.get("no_log", False), (
            f"{where}: the description says no_log exactly when the argument_spec has no_log"
        )


@pytest.mark.parametrize("name", MODULES)
def test_attributes_say_how_check_mode_goes(name):
    attributes = documented(name)[0].get("attributes") or {}
    check_mode = attributes.get("check_mode")
    assert check_mode, f"{name}: no attributes.check_mode"
    assert check_mode.get("support") in SUPPORT
    if check_mode["support"] == "partial":
        assert check_mode.get("details"), f"{name}: partial check mode support needs details"
    (call,) = ansible_module_calls(name)
    supports = keyword(call, "supports_check_mode")
    declared = isinstance(supports, ast.Constant) and supports.value is True
    assert (check_mode["support"] != "none") == declared, (
        f"{name}: attributes.check_mode.support against supports_check_mode={declared}"
    )
    assert attributes.get("diff_mode", {}).get("support") in SUPPORT, f"{name}: diff_mode"
    assert attributes.get("platform", {}).get("platforms"), f"{name}: platform"
    assert "ansible.builtin.action_common_attributes" in documented(name)[0].get(
        "extends_documentation_fragment", []
    )


@pytest.mark.parametrize("name", MODULES)
def test_every_example_is_a_task_that_calls_the_module(name, monkeypatch):
    spec = argument_spec(name, monkeypatch)
    required = {option for option, arg in spec.items() if arg.get("required")}
    for task in documented(name)[1]:
        assert isinstance(task, dict) and task.get("name"), f"{name}: an example without a name"
        calls = [key for key in (name, f"ansible.legacy.{name}") if key in task]
        assert len(calls) == 1, f"{name}: example {task['name']!r} does not call {name}"
        args = task[calls[0]]
        assert isinstance(args, dict), f"{name}: example {task['name']!r} has no options"
        assert set(args) <= set(spec), f"{name}: {task['name']!r}: unknown {set(args) - set(spec)}"
        assert required <= set(args), f"{name}: {task['name']!r}: missing {required - set(args)}"


def _check_return_docs(name: str, returns: dict, where: str) -> None:
    for key, doc in returns.items():
        for field in ("description", "returned", "type"):
            assert doc.get(field) is not None, f"{name}: RETURN {where}{key} has no {field}"
        if doc.get("contains"):
            _check_return_docs(name, doc["contains"], f"{where}{key}.")


@pytest.mark.parametrize("name", MODULES)
def test_return_documents_what_the_module_returns(name):
    returns = documented(name)[2]
    _check_return_docs(name, returns, "")
    tree = ast.parse((LIBRARY / f"{name}.py").read_text())
    exits = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "exit_json"
    ]
    assert exits, f"{name}: no exit_json call"
    returned = {k.arg for call in exits for k in call.keywords if k.arg} - COMMON_RETURN
    assert returned <= set(returns), f"{name}: RETURN lacks {sorted(returned - set(returns))}"


def ansible_doc(library: Path, *args: str) -> subprocess.CompletedProcess:
    executable = Path(sys.executable).with_name("ansible-doc")
    command = str(executable) if executable.exists() else shutil.which("ansible-doc")
    assert command, "ansible-doc not found (ansible-core is a dependency)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_NOCOLOR="1", ANSIBLE_LIBRARY=str(library), ANSIBLE_DEPRECATION_WARNINGS="0")
    return subprocess.run(
        [command, "-M", str(library), "-t", "module", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize("name", MODULES)
def test_ansible_doc_renders_the_module(name, monkeypatch):
    shown = ansible_doc(LIBRARY, name)
    assert shown.returncode == 0, shown.stderr
    assert not re.search(r"\[(ERROR|WARNING)\]", shown.stderr), shown.stderr
    assert shown.stdout.startswith(f"> MODULE {name} "), shown.stdout[:200]
    as_json = ansible_doc(LIBRARY, "--json", name)
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)[name]["doc"]  # with its doc fragments merged
    assert sorted(doc["options"]) == sorted(argument_spec(name, monkeypatch))
    assert doc["attributes"]["check_mode"]["support"] in SUPPORT


def test_a_module_without_documentation_fails(tmp_path):
    """The checks above catch a deleted DOCUMENTATION: the docs reader and ansible-doc both."""
    name = "ddops_bench"
    source = (LIBRARY / f"{name}.py").read_text()
    stripped = re.sub(r'^DOCUMENTATION = r""".*?"""\n', "", source, count=1, flags=re.S | re.M)
    assert stripped != source
    (tmp_path / f"{name}.py").write_text(stripped)
    with pytest.raises(AssertionError, match="has no DOCUMENTATION"):
        doc_strings(tmp_path / f"{name}.py")
    shown = ansible_doc(tmp_path, name)
    assert shown.returncode != 0 or "[ERROR]" in shown.stderr
