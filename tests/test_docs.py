"""The READMEs quote real commands: every `ddops ...` and `python -m engine ...` they name is a
command that exists, and every option quoted after it is one of that command's options (as its
`--help` lists them); every `python -m engine.MODULE` is a module.

Commands are read from fenced code blocks (a line each, backslash continuations joined, `#`
comments dropped) and from inline code spans.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re

import click
import pytest

from engine.__main__ import COMMANDS as ENGINE_COMMANDS
from engine.__main__ import _module_name
from ops.cli import cli as ddops_group
from tests.helpers import REPO

READMES = ("README.md", "engine/README.md", "ops/README.md")
# A snippet that starts with the command (a path before `ddops` allowed) quotes it.
DDOPS = re.compile(r"(?:/\S*/)?ddops((?:\s+\S+)*)")
ENGINE = re.compile(r"python -m engine((?:\s+\S+)*)")
ENGINE_MODULE = re.compile(r"python -m (engine\.[\w.]+)(?:\s+\S+)*")


def code_snippets(text: str) -> list[str]:
    """Each line of each fenced block, and each inline code span outside them."""
    snippets, prose = [], []
    for i, part in enumerate(re.split(r"^\s*```.*$", text, flags=re.M)):
        if i % 2:
            joined = re.sub(r"\\\n\s*", " ", part)
            snippets += [line.split("  #", 1)[0].strip() for line in joined.splitlines()]
        else:
            prose.append(part)
    snippets += re.findall(r"`([^`\n]+)`", "\n".join(prose))
    return [s for s in snippets if s]


def words(command: str) -> list[str]:
    """The words of a quoted command line, optional brackets and `a | b` spacing undone."""
    command = re.sub(r"\s*\|\s*", "|", command.replace("[", " ").replace("]", " "))
    return command.split()


def option_names(option: str) -> str:
    return option.split("=", 1)[0]


def click_options(command: click.Command) -> dict[str, click.Parameter]:
    found = {"-h": None, "--help": None}
    for param in command.params:
        for name in (*param.opts, *param.secondary_opts):
            if name.startswith("-"):
                found[name] = param
    return found


def takes_value(param: click.Parameter | None) -> bool:
    return isinstance(param, click.Option) and not param.is_flag and not param.count


def ddops_problems(args: list[str]) -> list[str]:
    """What in `ddops ARGS` is not a command or an option of the command it follows."""
    command, path, problems = ddops_group, ["ddops"], []
    args = iter(args)
    for word in args:
        if word == "..." or word.startswith(("<", "|")):
            break
        options = click_options(command)
        if word.startswith("-"):
            name = option_names(word)
            if name not in options:
                problems.append(f"{' '.join(path)} has no option {name}")
            elif takes_value(options[name]) and "=" not in word:
                next(args, None)
        elif isinstance(command, click.Group) and word in command.commands:
            command = command.commands[word]
            path.append(word)
        elif isinstance(command, click.Group) and not command.invoke_without_command:
            problems.append(f"{' '.join(path)} has no command {word}")
            break
    return problems


def engine_options(name: str) -> set[str]:
    parser = argparse.ArgumentParser()
    importlib.import_module(_module_name(name)).add_arguments(parser)
    return set(parser._option_string_actions)


def engine_problems(args: list[str]) -> list[str]:
    """What in `python -m engine ARGS` is not a command or an option of that command."""
    if not args or args[0] == "...":
        return []
    names = args[0].split("|")
    if missing := [n for n in names if n not in ENGINE_COMMANDS]:
        return [f"python -m engine has no command {m}" for m in missing]
    if len(names) > 1:
        return []
    options = engine_options(names[0])
    return [
        f"python -m engine {names[0]} has no option {option_names(word)}"
        for word in args[1:]
        if word.startswith("-") and option_names(word) not in options
    ]


def quoted_commands(text: str) -> list[tuple[str, re.Match]]:
    """("ddops" | "engine" | "module", match) of each snippet that quotes a command."""
    found = []
    for snippet in code_snippets(text):
        for kind, pattern in (("ddops", DDOPS), ("module", ENGINE_MODULE), ("engine", ENGINE)):
            if match := pattern.fullmatch(snippet):
                found.append((kind, match))
                break
    return found


def all_ddops_options(command: click.Command = ddops_group) -> set[str]:
    found = set(click_options(command))
    for sub in getattr(command, "commands", {}).values():
        found |= all_ddops_options(sub)
    return found


def all_engine_options() -> set[str]:
    return set().union(*(engine_options(name) for name in ENGINE_COMMANDS))


# A README's bare options (a code span that starts with one) belong to its part's commands.
BARE_OPTIONS = {"engine/README.md": all_engine_options, "ops/README.md": all_ddops_options}


def bare_option_problems(text: str, known: set[str]) -> list[str]:
    """Each option quoted on its own (`--flag`, `-i/--inventory FILE`) that no command has."""
    problems = []
    for snippet in code_snippets(text):
        if re.match(r"-[-\w]", snippet):
            for name in snippet.split()[0].split("/"):
                if option_names(name) not in known:
                    problems.append(f"no command has option {option_names(name)}")
    return problems


def problems_in(text: str) -> list[str]:
    problems = []
    for kind, match in quoted_commands(text):
        if kind == "ddops":
            problems += ddops_problems(words(match[1]))
        elif kind == "engine":
            problems += engine_problems(words(match[1]))
        elif importlib.util.find_spec(match[1]) is None:
            problems.append(f"no module {match[1]}")
    return problems


def test_a_made_up_command_or_option_is_found():
    text = """
Run `ddops health --ct 200 --no-such-flag`, `ddops frobnicate` and `python -m engine.nothing`.

```sh
python -m engine plan --model DIR \\
    [--bogus N]   # a comment --not-checked
python -m engine fly
ddops -i site.yml bench report RUN_DIR --quiet-please
```
"""
    assert problems_in(text) == [
        "python -m engine plan has no option --bogus",
        "python -m engine has no command fly",
        "ddops bench report has no option --quiet-please",
        "ddops health has no option --no-such-flag",
        "ddops has no command frobnicate",
        "no module engine.nothing",
    ]


def test_real_commands_and_options_pass():
    text = (
        "`ddops --host sim:PATH provision --ct N --dry-run`, `ddops sim init PATH --gpus 2`, "
        "`python -m engine generate | serve | bench`, `python -m engine serve --model DIR`, "
        "`/usr/local/bin/ddops -i /etc/ddops/site.yml recover --ct N`, the `ddops` CLI"
    )
    assert problems_in(text) == []


def test_a_bare_option_no_command_has_is_found():
    text = "`--json`, `-i/--inventory FILE`, `--host local\\|sim:PATH`, `--frob 3`, `-z`"
    assert bare_option_problems(text, all_ddops_options()) == [
        "no command has option --frob",
        "no command has option -z",
    ]


@pytest.mark.parametrize("readme", READMES)
def test_every_command_and_option_a_readme_quotes_exists(readme):
    text = (REPO / readme).read_text()
    assert len(quoted_commands(text)) >= 5
    assert problems_in(text) == []


@pytest.mark.parametrize("readme", sorted(BARE_OPTIONS))
def test_every_option_a_part_quotes_on_its_own_exists(readme):
    text = (REPO / readme).read_text()
    assert bare_option_problems(text, BARE_OPTIONS[readme]()) == []
