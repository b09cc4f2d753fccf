"""engine/tools/step_ops.py on a tiny hybrid pair: every part counted, and its refusals."""

from __future__ import annotations

import json

import pytest

from engine.tools.step_ops import main
from tests.helpers.tiny_pairs import save_byte_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_byte_pair(tmp_path_factory.mktemp("step-ops"), "hybrid")


def test_counts_every_part_of_batched_ddtree_steps(pair):
    lines = []
    target, draft = pair
    args = ["--model", str(target), "--draft", str(draft), "--concurrency", "3"]
    assert main([*args, "--max-tokens", "12", "--json"], out=lines.append) == 0
    report = json.loads(lines[0])
    assert set(report["ops"]) == {
        "step",
        "target_pass",
        "draft_pass",
        "context_write",
        "tree",
        "commit",
        "cache_commit",
    }
    passes = {name: ops for name, ops in report["ops"].items() if name != "tree"}
    assert all(ops > 0 for ops in passes.values()) and all(report["calls"].values())
    assert report["ops"]["step"] > report["ops"]["target_pass"]  # a step holds its pass
    # the caches' commit is the step's, not each sequence's walk
    assert report["ops"]["cache_commit"] > report["ops"]["commit"]
    # a tree beside others reads its draft's top-k read back for the whole batch: no ops
    assert report["ops"]["tree"] < 1
    assert report["tokens"] == 3 * 12


@pytest.mark.parametrize("method", ["tree:4", "ddtree:x", "ddtree:0"])
def test_a_bad_method_is_one_line_and_exit_2(pair, method, capsys):
    target, draft = pair
    assert main(["--model", str(target), "--draft", str(draft), "--method", method]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--method" in err
