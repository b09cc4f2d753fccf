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

    def row(method: str, tau: float, rate: float, low: float, speedup: float, high: float):
        figures = {"speedup": speedup, "speedup_low": low, "speedup_high": high, "repeats": 5}
        return {"method": method, "tau": tau, "decode_tok_s": rate, **figures}

    rows = [
        row("ar", 1.0, 100.0, 1.0, 1.0, 1.0),
        row("linear", 2.2, 110.0, 1.02, 1.1, 1.15),
        row("ddtree:15", 3.0, 140.0, 1.31, 1.4, 1.52),
    ]
    text = "no clear winner at this noise (intervals overlap): leaders ddtree:4 1.28x (1.20-1.35)"
    bench = {
        "rows": rows,
        "verdicts": [{"text": text + ", ddtree:8 1.28x (1.18-1.33), ddtree:15 1.10x (1.02-1.21)"}],
        "machine": {"warning": "the machine was busy: other processes used 43% of the CPU"},
    }
    turn = {"cached_tokens": 0, "ttft_on_s": {"median": 0.09}, "ttft_off_s": {"median": 0.1}}
    later = {"cached_tokens": 830, "ttft_on_s": {"median": 0.05}, "ttft_off_s": {"median": 0.3}}
    agentic = {"rows": [{"method": "ddtree:15", "turns": [turn, later]}]}

    def served(method: str, level: int, tok_s: float, ttft_s: float) -> dict:
        return {"method": method, "concurrency": level, "output_tok_s": tok_s, "ttft_p50_s": ttft_s}

    serving = {
        "rows": [
            *(served("ar", 1, 40.2, 0.031), served("ar", 4, 39.6, 0.95)),
            *(served("ddtree:15", 1, 81.0, 0.03), served("ddtree:15", 4, 80.4, 0.47)),
            *(served("default", 1, 80.6, 0.03), served("default", 4, 79.9, 0.48)),
        ]
    }
    reboot = {"uvm_major_before": 511, "uvm_major": 509, "units": ["a", "b"]}
    result = DemoResult(
        tmp_path,
        "http://hub",
        [
            Stage("sim reboot", [], seconds=22.0, document=reboot, hub_bytes=0),
            Stage("health after reboot", [], seconds=3.4, document=health),
            Stage("bench", [], seconds=60.0, document=bench),
            Stage("bench agentic", [], seconds=30.0, document=agentic),
            Stage("bench serving", [], seconds=40.0, document=serving),
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
    assert "  ddtree:15    3.00    140.0   1.40x (1.31-1.52)" in lines
    assert "  ar           1.00    100.0   1.00x" in lines
    assert lines[lines.index("  ddtree:15    3.00    140.0   1.40x (1.31-1.52)") + 2] == (
        "Verdict: no clear winner at this noise (intervals overlap): leaders ddtree:4 1.28x (1.20-1.35),"
    )
    assert "Warning: the machine was busy: other processes used 43% of the CPU." in lines
    assert "Prefix cache, ddtree:15, TTFT by turn: 90/50 ms; cache off: 100/300 ms" in lines
    assert any("tokens cached by turn 0/830" in line for line in lines)
    assert "3 methods x 1 and 4 clients at once, 32 new tokens" in lines[5]
    assert (
        "Serving, tok/s (p50 TTFT ms) at c1 / c4: ar 40 (31) / 40 (950); ddtree:15 81 (30) / 80 "
        "(470); default 81 (30) / 80 (480)"
    ) in " ".join(lines)
    assert f"report:    {tmp_path / 'run' / 'report.md'}" in lines
    assert lines[-1] == f"  ddops sim destroy {tmp_path / 'host'}"
    # With the record's timings, the checks after the engine's are not the engine's wait.
    last = health["cts"][0]["last_recover"]
    last["timings"] = {"model": 3.0, "engine": 1.0, "boot-kernel": 0.7, "host-ddops": 0.5}
    told = story_lines(result)
    assert (
        "  reboot -> healthy engine in 20.8 s (the recover 19.6 s), 0 bytes downloaded from the hub"
    ) in told
    assert "  then 1.2 s of the checks after the engine's, while it served" in told
    assert max(map(len, told)) <= 100
