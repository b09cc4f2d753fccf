"""The hybrid target's static verify keeps what commit needs three ways, all committing the same.

"factored" (the CPU's), "snapshot" (commit by selection: every node's state kept, the accepted
one copied) and "replay" (the accepted path re-run) must decode the same tokens and leave the
same committed state; `choose_keep` takes the snapshot only where a round's states fit.

Run: python -m pytest -q tests/engine/test_commit_by_selection.py
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.decode import GenerationConfig, generate
from engine.memory_plan import TargetShape
from engine.models import gated_deltanet, qwen3_5
from engine.models.gated_deltanet import (
    choose_keep,
    choose_strategy,
    factored_fits,
    keep_for,
    pending_bytes,
    qwen36_27b_shape,
)
from tests.helpers import DATA
from tests.helpers.tiny_pairs import load_tiny_pair

MIB = 1 << 20


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp("hybrid"), "hybrid")


def decode_keeping(target, drafter, keep: str, monkeypatch) -> tuple[list[int], list[torch.Tensor]]:
    monkeypatch.setattr(qwen3_5, "choose_keep", lambda *args: keep)
    caches = []
    new_cache = target.new_cache
    monkeypatch.setattr(target, "new_cache", lambda *a: caches.append(new_cache(*a)) or caches[-1])
    cfg = GenerationConfig(method="ddtree", budget=6, max_new_tokens=24)
    result = generate(target, drafter, [5, 9, 17, 4, 30, 8, 11], cfg)
    assert caches[0].keep == keep
    return result.output_ids, [state.recurrent.clone() for state in caches[0].recurrent]


def test_snapshot_and_replay_commit_what_the_factored_solve_commits(pair, monkeypatch):
    target, drafter = pair
    want_ids, want_states = decode_keeping(target, drafter, "factored", monkeypatch)
    for keep in ("snapshot", "replay"):
        ids, states = decode_keeping(target, drafter, keep, monkeypatch)
        assert ids == want_ids, keep
        for got, want in zip(states, want_states, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_snapshot_is_taken_where_a_round_of_states_fits(monkeypatch):
    shape = qwen36_27b_shape()
    snapshot = pending_bytes(shape, 48, 16, "snapshot", torch.bfloat16)
    assert snapshot == 2319 * MIB  # 16 nodes x 48 layers x 3 MiB of state, plus conv inputs
    weight = torch.empty(0, dtype=torch.bfloat16)
    monkeypatch.setattr(gated_deltanet, "backend_for", lambda tensor: "triton")
    for free, keep in ((2 * snapshot, "snapshot"), (2 * snapshot - 1, "replay")):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 0))
        assert choose_keep(shape, 48, weight) == keep
    monkeypatch.setattr(gated_deltanet, "backend_for", lambda tensor: "batched")
    assert choose_keep(shape, 48, weight) == "factored"


def test_a_verify_wider_than_the_snapshot_was_sized_for_replays():
    assert keep_for("snapshot", 16) == "snapshot"
    assert keep_for("snapshot", 17) == "replay"
    assert keep_for("factored", 65) == "factored"


def test_a_batched_pass_solves_its_trees_factored_on_every_device_and_the_plan_counts_it():
    """At Qwen3.6-27B's widths a lone 16-token tree on CUDA (Triton) replays, but a batched
    pass's trees are solved together, factored, on every device: one set of calls a layer
    for all its sequences, not a kernel, conv, heads and commit per sequence per layer. The
    memory plan's verify share counts the larger pending of the two, the factored one."""
    shape = qwen36_27b_shape()
    assert choose_strategy(shape, 16, torch.float32, "triton") == "replay"
    assert factored_fits(shape, 16, torch.float32)
    target = TargetShape.from_config(
        json.loads((DATA / "qwen36_27b/target/config.json").read_text())
    )
    factored = pending_bytes(shape, 48, 16, "factored", torch.bfloat16)
    assert target.verify_pending_bytes(16, width=2, compute=4) == factored
    assert factored > pending_bytes(shape, 48, 16, "replay", torch.bfloat16)
