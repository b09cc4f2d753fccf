"""engine/tools/gdn_state_cost.py at Qwen3.6-27B's real GDN widths (one layer, random weights):
its report, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.tools.gdn_state_cost import main

QWEN36_27B = Path(__file__).resolve().parents[2] / "data" / "qwen36_27b" / "target"


def test_reports_each_row_counts_step_and_the_commit_at_real_widths(capsys):
    assert main(["--model", str(QWEN36_27B), "--rows", "1,2", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shape"]["value_heads"] == 48 and report["shape"]["key_dim"] == 128
    assert report["state_bytes"] == 48 * 128 * 128 * 4  # float32: 3 MiB a layer a sequence
    assert set(report["single_steps_s"]) == {"1", "2"}
    assert all(seconds > 0 for seconds in report["single_steps_s"].values())
    assert report["commit_state_s"] > 0


@pytest.mark.parametrize("rows", ["0", "1,x", ""])
def test_bad_rows_exit_2(rows, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(QWEN36_27B), "--rows", rows])
    assert exit_.value.code == 2
    assert "--rows" in capsys.readouterr().err


def test_a_directory_without_a_config_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a Qwen3.5/3.6 config" in err
