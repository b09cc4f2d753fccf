"""engine/tools/ddtree_reference.py: the round-by-round tree comparison and its refusals (the
reference itself is not part of the repository, so its runs are not tested here)."""

from __future__ import annotations

import torch

from engine.tools.ddtree_reference import compare_trees, main, ops_per_round


def ours(tokens, parents, accepted):
    return {"tree": {"tokens": tokens, "parents": parents}, "accepted": accepted}


def theirs(tokens, parents, accepted):
    return {
        "tree": {"node_token_ids": tokens, "parents": [-1, *parents]},
        "accepted_indices": [0, *accepted],
    }


def test_identical_rounds_are_counted_and_the_first_difference_named():
    same = ([5, 6, 7], [0, 1, 0], [1, 2])
    mine = [ours(*same), ours([5, 6, 7], [0, 0, 0], [1]), ours(*same)]
    reference = [theirs(*same), theirs(*same), theirs(*same)]
    report = compare_trees(mine, reference, depth=3, new_tokens=100)
    assert report == {
        "rounds": 3,
        "reference_rounds": 3,
        "identical": 2,
        "shrunk": 0,
        "first_difference": 1,
    }


def test_a_different_accepted_path_is_a_difference():
    report = compare_trees(
        [ours([5, 6], [0, 1], [1])], [theirs([5, 6], [0, 1], [1, 2])], depth=2, new_tokens=100
    )
    assert (report["identical"], report["first_difference"]) == (0, 0)


def test_rounds_drafted_short_of_the_output_limit_are_counted_apart():
    # The prefill's token, then rounds committing 3, 1 and 3 tokens with room 8, 5 and 4 for
    # a depth-3 draft; the last round's room is 10 - 8 - 1 = 1: ours drafted short there.
    tree = ([5, 6, 7], [0, 1, 2], [1, 2])
    mine = [ours(*tree), ours(*tree[:2], []), ours(*tree), ours([9], [0], [])]
    reference = [
        theirs(*tree),
        theirs(*tree[:2], []),
        theirs(*tree),
        theirs([1, 2, 3], [0, 1, 2], []),
    ]
    report = compare_trees(mine, reference, depth=3, new_tokens=10)
    assert (report["identical"], report["shrunk"], report["first_difference"]) == (3, 1, None)


def test_a_directory_without_the_reference_is_refused_in_one_line(tmp_path, capsys):
    code = main(["--reference", str(tmp_path), "--model", str(tmp_path), "--draft", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "ddtree.py" in err


def test_a_count_below_one_is_refused(tmp_path, capsys):
    (tmp_path / "ddtree.py").write_text("")
    args = ["--reference", str(tmp_path), "--model", str(tmp_path), "--draft", str(tmp_path)]
    assert main([*args, "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


def test_the_cpu_clock_is_this_threads_cpu_time_while_it_lasts():
    import time

    from engine.tools.ddtree_reference import clock

    wall = time.perf_counter
    with clock("cpu"):
        assert time.perf_counter is time.thread_time
    assert time.perf_counter is wall
    with clock("wall"):
        assert time.perf_counter is wall


def test_the_cpu_clock_with_several_threads_is_refused(tmp_path, capsys):
    (tmp_path / "ddtree.py").write_text("")
    args = ["--reference", str(tmp_path), "--model", str(tmp_path), "--draft", str(tmp_path)]
    assert main([*args, "--clock", "cpu", "--threads", "2"]) == 2
    assert "--threads 1" in capsys.readouterr().err


def test_ops_per_round_counts_every_torch_op_of_a_traced_run_over_its_rounds():
    def run(ids, budget, new_tokens, trace):
        assert trace
        x = torch.ones(3)
        (x + 1).sum().view(1)  # add, sum, view
        return {"rounds": [{}, {}]}

    assert ops_per_round(run, [1, 2], 15, 8) == 2.0  # ones + 3, over 2 rounds
