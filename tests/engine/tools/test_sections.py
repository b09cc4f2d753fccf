"""engine/tools/sections.py: a run kept section by section (a device run cut off returns what
finished), a raising section recorded while the next ones run, a deadline between sections."""

from __future__ import annotations

import json

from engine.tools.sections import Section, run_sections, write_json


def failing() -> object:
    raise RuntimeError("out of memory at 64 layers")


def test_each_section_is_saved_as_it_ends_and_a_raising_one_does_not_stop_the_next(capsys):
    saved = []
    report = run_sections(
        [Section("first", lambda: 1), Section("second", failing), Section("third", lambda: 3)],
        {"device": "test"},
        lambda report: saved.append(json.loads(json.dumps(report))),
    )
    assert [sorted(s) for s in saved] == [
        ["device", "errors", "first", "skipped"],
        ["device", "errors", "first", "skipped"],
        ["device", "errors", "first", "skipped", "third"],
    ]
    assert report["errors"] == {"second": "RuntimeError: out of memory at 64 layers"}
    assert (report["first"], report["third"], report["skipped"]) == (1, 3, [])
    err = capsys.readouterr().err
    assert "Traceback" in err and "second: raised after" in err and "third: done in" in err


def test_no_section_starts_past_the_deadline():
    now = [0.0]

    def taking(seconds: float, value: int):
        def run() -> int:
            now[0] += seconds
            return value

        return run

    sections = [
        Section("a", taking(50, 1)),
        Section("b", taking(60, 2)),
        Section("c", taking(1, 3)),
    ]
    report = run_sections(sections, {}, lambda report: None, deadline=100, clock=lambda: now[0])
    assert (report["a"], report["b"], report["skipped"]) == (1, 2, ["c"])  # b began at 50 s


def test_the_report_is_written_whole_and_no_temporary_file_is_left(tmp_path):
    path = tmp_path / "report.json"
    write_json(path, {"a": 1})
    write_json(path, {"a": 2, "b": [1, 2]})
    assert json.loads(path.read_text()) == {"a": 2, "b": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
