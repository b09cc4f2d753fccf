"""The ddops group: version, help, and the error convention at the CLI edge."""

from __future__ import annotations

import click
from click.testing import CliRunner

from ops import __version__
from ops.cli import cli
from ops.errors import DdopsError


def test_version_and_help():
    runner = CliRunner()
    result = runner.invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"ddops, version {__version__}"
    result = runner.invoke(cli, ["--help"])
    assert result.exit_code == 0
    for option in ("--inventory", "--host", "--json", "--verbose"):
        assert option in result.output


def test_domain_error_is_one_line_and_exit_1():
    @cli.command("explode-for-test", hidden=True)
    def explode() -> None:
        raise DdopsError("CT 200", "/dev/nvidia-uvm major 509 is not allowed by the CT config")

    try:
        result = CliRunner().invoke(cli, ["explode-for-test"])
    finally:
        cli.commands.pop("explode-for-test")
    assert result.exit_code == 1
    assert result.output.splitlines()[0] == (
        "Error: CT 200: /dev/nvidia-uvm major 509 is not allowed by the CT config"
    )


def test_usage_error_exits_2():
    result = CliRunner().invoke(cli, ["no-such-command"])
    assert result.exit_code == 2
    assert isinstance(click.UsageError("x"), click.ClickException)


def test_demo_summary_lists_stages_and_says_how_to_remove_the_host_it_leaves_up(tmp_path):
    from ops.demo import DemoResult, Stage, summary_lines

    result = DemoResult(tmp_path, [Stage("sim init", ["sim", "init"], seconds=0.5)])
    lines = summary_lines(result)
    assert any(line.split()[:4] == ["sim", "init", "exit", "0"] for line in lines)
    assert lines[-1].endswith(f"`ddops sim destroy {tmp_path / 'host'}` removes it")
    assert not any("destroy" in line for line in summary_lines(DemoResult(tmp_path)))
