"""`python -m engine <command>`: generate, serve, bench, train-demo, plan.

Each command is a module in engine/cli/ with `add_arguments(parser)` and `run(args) -> int`;
a command is listed only when its module exists, and imported only when it runs, so
`python -m engine --help` stays fast (no torch import).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

COMMANDS = {
    "generate": "Generate from a prompt with ar, linear (DFlash chain) or ddtree decoding.",
    "serve": "Serve an OpenAI-compatible HTTP API.",
    "bench": "Benchmark ar / linear / ddtree on held-out prompts.",
    "train-demo": "Train the tiny demo target and its DFlash drafter.",
    "plan": "Memory plan: weights, KV per token, the longest context that fits a device.",
}


def _module_name(command: str) -> str:
    return "engine.cli." + command.replace("-", "_")


def available_commands() -> dict[str, str]:
    return {c: h for c, h in COMMANDS.items() if importlib.util.find_spec(_module_name(c))}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = available_commands()
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in commands.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in commands:
        parser.parse_args(argv)  # prints usage / help and exits
    module = importlib.import_module(_module_name(argv[0]))
    command_parser = argparse.ArgumentParser(
        prog=f"python -m engine {argv[0]}", description=commands[argv[0]]
    )
    module.add_arguments(command_parser)
    return module.run(command_parser.parse_args(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
