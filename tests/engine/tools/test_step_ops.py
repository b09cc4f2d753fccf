"""engine/tools/step_ops.py on a tiny hybrid pair: every part counted, and its refusals."""

from __future__ import annotations

import json

import pytest
import torch

from engine import kernels
from engine.models import common
from engine.tools.ddtree_reference import OpCount
from engine.tools.step_ops import cuda_launches, main
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
        "decode_step",
        "target_pass",
        "decode_pass",
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


def random_report(*args: str) -> dict:
    lines: list[str] = []
    argv = ["--random-layers", "4", "--max-tokens", "4", "--json", *args]
    assert main(argv, out=lines.append) == 0
    return json.loads(lines[0])


def test_random_layers_count_the_decode_passes_apart_from_the_prefills():
    report = random_report("--concurrency", "2")
    assert report["settings"]["random_layers"] == 4
    assert report["tokens"] == 2 * 4  # random prompts, no stop token: every token generated
    calls = report["calls"]
    assert 0 < calls["decode_pass"] < calls["target_pass"]  # the prompts' passes left out
    assert 0 < calls["decode_step"] < calls["step"]


def test_cuda_launches_count_the_paged_launch_as_one_op(monkeypatch):
    """CUDA attends every sequence of a batched pass in one paged launch; the CPU's reference
    of that kernel loops over the sequences: counted as CUDA's launch, a pass's ops grow far
    less with its sequences than the reference's loop makes them."""

    def added(*args: str) -> float:
        passes = [random_report("--concurrency", n, *args)["ops"]["decode_pass"] for n in "26"]
        return (passes[1] - passes[0]) / 4  # a decoding sequence's ops in the pass

    chosen = (kernels._implementation, kernels._fused_implementation)
    launches = added("--cuda-launches")
    assert common.ONE_LAUNCH_DEVICES == ("cuda",)  # as they were after the run
    assert (kernels._implementation, kernels._fused_implementation) == chosen
    monkeypatch.setattr(common, "ONE_LAUNCH_DEVICES", ("cuda", "cpu"))  # the reference's loop
    assert launches < added() / 2


def test_graphs_count_each_static_pass_as_one_replay():
    """With --graphs the steps run by their buckets' static passes, each pass one op (its
    replay): a decoding step of trees then dispatches a fraction of its eager ops."""
    args = ("--concurrency", "3", "--method", "ddtree:3", "--cuda-launches")
    eager, graphed = random_report(*args), random_report(*args, "--graphs")
    assert "tree_step_pass" not in eager["ops"]
    assert graphed["calls"]["tree_step_pass"] > 0 and graphed["tokens"] == eager["tokens"]
    assert graphed["ops"]["tree_step_pass"] < eager["ops"]["decode_pass"] / 4
    assert graphed["ops"]["tree_step_commit"] < eager["ops"]["cache_commit"] / 2
    assert graphed["ops"]["decode_step"] < eager["ops"]["decode_step"] * 3 / 4


def test_a_kernel_with_a_triton_form_counts_as_one_op():
    x, weight = torch.randn(4, 8), torch.ones(8)
    with OpCount() as plain:
        expected = kernels.rms_norm(x, weight, 1e-6)
    with cuda_launches(), OpCount() as launched:
        out = kernels.rms_norm(x, weight, 1e-6)
    assert plain.ops > 1 and launched.ops == 1
    assert torch.equal(out, expected)
