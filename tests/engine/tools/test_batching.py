"""engine/tools/batching.py: what its report makes of the answers (a run against a server is
issue 36's measurement, engine/NOTES.md, not a test)."""

from __future__ import annotations

import argparse

import pytest

from engine.tools.batching import lines, longest_over_mean


def answer(rounds: int) -> dict:
    return {"speculative": {"method": "ddtree", "budget": 15, "rounds": rounds}}


def test_the_longest_requests_rounds_are_read_over_their_mean():
    assert longest_over_mean([answer(r) for r in (10, 20, 30)]) == pytest.approx(1.5)
    assert longest_over_mean([answer(96)] * 6) == 1.0


def test_the_report_shows_each_methods_tail_beside_its_ratio():
    figure = {"median": 2.0, "low": 1.5, "high": 2.5}
    tail = {"median": 1.75, "low": 1.6, "high": 1.9}
    row = {
        "one_after_another_tok_s": figure,
        "at_once_tok_s": figure,
        "ratio": figure,
        "longest_over_mean_rounds": tail,
    }
    ttft = {
        "long_prompt_tokens": 3300,
        "prefill_s": figure,
        "short_ttft_s": figure,
        "short_over_prefill": figure,
    }
    report = {"methods": {"ddtree:15": row}, "ttft": ttft, "equal": True}
    shown = lines(report, argparse.Namespace(concurrency=6, repeats=3))
    assert "longest request's rounds 1.75x [1.60-1.90] the mean" in shown[1]
