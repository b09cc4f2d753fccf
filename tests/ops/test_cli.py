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


def test_demo_story_tells_the_boot_repair_and_the_bench_winner_in_one_screen(tmp_path):
    from ops.demo_story import DemoResult, Stage, story_lines

    fixed = {"key": "ct-config", "title": "CT config grants current majors", "found": "allows 511"}
    health = {
        "ok": True,
        "cts": [
            {
                "checks": [{"status": "ok"}] * 11,
                "last_recover": {
                    "trigger": "boot",
                    "seconds": 20.8,
                    "repaired": [{**fixed, "done": "wrote 509"}],
                },
            }
        ],
    }
    rows = [
        {"method": "ar", "tau": 1.0, "decode_tok_s": 100.0, "speedup": 1.0},
        {"method": "linear", "tau": 2.2, "decode_tok_s": 110.0, "speedup": 1.1},
        {"method": "ddtree:15", "tau": 3.0, "decode_tok_s": 140.0, "speedup": 1.4},
    ]
    reboot = {"uvm_major_before": 511, "uvm_major": 509, "units": ["a", "b"]}
    result = DemoResult(
        tmp_path,
        "http://hub",
        [
            Stage("sim reboot", [], seconds=22.0, document=reboot, hub_bytes=0),
            Stage("health after reboot", [], seconds=3.4, document=health),
            Stage("bench", [], seconds=60.0, document={"rows": rows}),
        ],
        report=tmp_path / "run" / "report.md",
    )
    lines = story_lines(result)
    assert len(lines) <= 60 and max(map(len, lines)) <= 100
    assert lines[1].split()[:2] == ["sim", "reboot"] and "uvm 511 -> 509" in lines[1]
    assert "CT 200 healthy: 11 ok checks" in lines[2]
    assert "    found: allows 511" in lines and "    did:   wrote 509" in lines
    assert (
        "  reboot -> healthy engine in 22.0 s (the recover 20.8 s), 0 bytes downloaded from the hub"
        in lines
    )
    assert "ddtree:15 won: 1.40x over ar (DFlash chain: 1.10x)." in lines
    assert f"report:    {tmp_path / 'run' / 'report.md'}" in lines
    assert lines[-1] == f"  ddops sim destroy {tmp_path / 'host'}"
