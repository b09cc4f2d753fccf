"""A scheduler's plain steps by their bucket's static pass (engine/step_passes.py), on the CPU.

What CUDA replays as one captured graph a bucket runs here eagerly, forced: each sequence still
equals its solo run (float64, dense and hybrid, sequences joining so the buckets pad), padding
rows write no sequence's keys, and the pass compiles whole (`fullgraph=True`, as the static
passes of test_graph_safe.py) and serves other sequences at other lengths without recompiling.
Its first call on CUDA (CUDA faked) steps the GDN states it commits once, not twice.

    python -m pytest -q tests/engine/test_step_passes.py
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engine import kv_blocks
from engine.decode import GenerationConfig, StaticPass
from engine.grammar import Constraint
from engine.models import common
from engine.models.common import Segment
from engine.step_passes import StepPasses, kv_of
from tests.helpers import batched_requests as batch
from tests.helpers.static_outputs import assert_same
from tests.helpers.tiny_grammar import STOP, char_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread", "fresh_dynamo")

NEW = 24


@pytest.fixture
def pair(float64_pair):
    return float64_pair


def counted_steps(sched, monkeypatch) -> list[list[int]]:
    """Forces the static passes on the scheduler; each step they run, as [its sequences, the
    bucket's rows]."""
    sched.steps = StepPasses(sched.target, graphs=False)
    steps: list[list[int]] = []
    filled, forward = sched.steps.filled, sched.target.forward_steps

    def filling(bonuses, segments, layers):
        steps.append([len(segments)])
        return filled(bonuses, segments, layers)

    def forwarding(inputs, layers=()):
        steps[-1].append(inputs.ids.shape[0])
        return forward(inputs, layers)

    monkeypatch.setattr(sched.steps, "filled", filling)
    monkeypatch.setattr(sched.target, "forward_steps", forwarding)
    return steps


def test_plain_steps_by_their_buckets_passes_equal_solo_runs(pair, monkeypatch):
    """ar (greedy, sampled, under a grammar) and auto sequences, one, then two, then two more
    joining: the plain steps of three run in a bucket of 4 (a padding row), five in 8."""
    vocab = pair[0].lm_head.weight.shape[0]
    grammar = Constraint.from_json_schema(char_tokenizer(vocab), batch.SCHEMA)
    plain = GenerationConfig("ar", max_new_tokens=NEW, prefill_chunk=16)
    cfgs = [
        plain,
        replace(plain, temperature=0.8, seed=5),
        replace(plain, constraint=grammar, stop_token_ids=(STOP,)),
        replace(plain, method="auto", budget=6),
        plain,
    ]
    cases = list(zip(batch.prompts(pair, [5, 30, 9, 20, 12], seed=3), cfgs, strict=True))
    sched, got = batch.scheduler(pair, slots=5, tokens=64), batch.Collector()
    steps = counted_steps(sched, monkeypatch)
    for index, case in enumerate(cases):
        sched.add(got.request(index, *case))
        if index in (0, 2):  # one alone, then three
            for _ in range(6):
                sched.step()
    batch.drain(sched)
    for index, (prompt, cfg) in enumerate(cases):
        assert got.output(index) == batch.solo(pair, prompt, replace(cfg, method="ar")), index
    buckets = {count: rows for count, rows in steps}
    assert buckets.get(3) == 4 and buckets.get(5) == 8, buckets


def prefilled(pair, lengths: list[int]) -> list:
    """Caches holding random prompts and the block of their next token."""
    return batch.prefilled_caches(pair, lengths, room=1)


def segments_of(caches: list, bonuses: list[int]) -> list[Segment]:
    return [Segment(torch.tensor([b]), cache) for b, cache in zip(bonuses, caches, strict=True)]


def test_padding_rows_store_keys_in_the_padding_block_alone(pair):
    """A step of three in a bucket of four: the pool changes only at the three sequences'
    pending slots and in the padding block."""
    caches = prefilled(pair, [9, 14, 5])
    kv = [kv_of(cache) for cache in caches]
    pool = kv[0].pool
    padding = pool.padding_block()
    before = pool.k.clone()
    StepPasses(pair[0], graphs=False).run([5, 6, 7], segments_of(caches, [5, 6, 7]), ())
    changed = (pool.k != before).flatten(3).any(-1).any(0).nonzero().tolist()  # (block, slot)
    pending = {(c.blocks[c.length // pool.block_tokens], c.length % pool.block_tokens) for c in kv}
    assert {tuple(at) for at in changed if at[0] != padding} == pending
    assert [padding, 0] in changed  # the padding row's own key


def steps_attention(q, k_blocks, v_blocks, tables, starts, prefixes, visible, scale):
    """`paged_tree_attention` of one query a sequence (a plain step) in a fixed set of calls:
    every row's whole table gathered, the keys past its own masked (graph-safe)."""
    B, W = tables.shape
    block = k_blocks.shape[1]
    slots = (tables[:, :, None] * block + torch.arange(block)).flatten(1)  # [B, W * block]
    keys, values = (x.flatten(0, 1)[slots].transpose(1, 2) for x in (k_blocks, v_blocks))
    seen = torch.arange(W * block) <= prefixes[:, None]  # its committed keys and its own
    mask = torch.zeros(seen.shape, dtype=q.dtype).masked_fill(~seen, float("-inf"))
    out = F.scaled_dot_product_attention(
        q[:, :, None], keys, values, mask[:, None, None], scale=scale, enable_gqa=True
    )
    return out[:, :, 0]


def test_a_plain_step_compiles_as_one_graph_and_serves_other_sequences(pair, monkeypatch):
    """The bucket's pass compiles whole, matches eager, and runs other sequences (other
    slots, lengths and tokens) from the same buffers without recompiling."""
    target, drafter = pair
    monkeypatch.setattr(kv_blocks, "paged_tree_attention", steps_attention)
    caches = prefilled(pair, [9, 14, 5, 20])
    passes, layers = StepPasses(target, graphs=False), drafter.target_layer_ids
    step = passes.filled([5, 6, 7], segments_of(caches[:3], [5, 6, 7]), layers)
    states = committed_states(caches[0])
    want = step.run(), committed_states(caches[0])  # (eager first: the pool's views are made)
    restore(caches[0], states)
    compiled = torch.compile(step.run, fullgraph=True, backend="eager")
    assert_same((compiled(), committed_states(caches[0])), want)
    others = [caches[3], caches[0], caches[2]]
    assert passes.filled([8, 9, 10], segments_of(others, [8, 9, 10]), layers) is step
    states = committed_states(caches[0])
    with torch.compiler.set_stance("fail_on_recompile"):
        got = compiled(), committed_states(caches[0])
    restore(caches[0], states)
    assert_same(got, (step.run(), committed_states(caches[0])))


def committed_states(cache) -> list[torch.Tensor]:
    """Copies of every GDN layer's states of every slot (the pass commits them)."""
    return [part.clone() for part in state_parts(cache)]


def restore(cache, states: list[torch.Tensor]) -> None:
    for part, saved in zip(state_parts(cache), states, strict=True):
        part.copy_(saved)


def state_parts(cache) -> list[torch.Tensor]:
    """The conv and recurrent tensors of the `StateSlots` of every GDN layer of `cache`."""
    slots = [state.slots for state in getattr(cache, "recurrent", [])]
    return [part for rows in slots for part in (rows.conv, rows.recurrent)]


def test_with_trees_beside_them_preemption_and_the_prefix_cache_outputs_equal_solo_runs(
    pair, monkeypatch
):
    """What CUDA runs, forced on the CPU: plain steps by their bucket's pass, the other steps'
    attention in one paged launch; every method, greedy and sampled (the ar ones longer, so
    they step on after the trees), over a pool too small for them all (preemptions) beside a
    prefix cache of its blocks."""
    monkeypatch.setattr(common, "ONE_LAUNCH_DEVICES", ("cpu",))
    cfgs = [replace(c, max_new_tokens=40) if c.method == "ar" else c for c in batch.configs()]
    cases = list(zip(batch.prompts(pair, [5, 40, 9, 70, 3, 22], seed=9), cfgs, strict=True))
    sched = batch.preempting_scheduler(pair)
    steps = counted_steps(sched, monkeypatch)
    batch.assert_solo_outputs(sched, pair, cases)
    assert sched.preemptions >= 1 and steps


class FakeCUDA:
    """CUDA's streams and graphs faked: what a static pass runs is counted in `ran` ("run",
    "replay"); a capture raises `failure` if set."""

    def __init__(self, monkeypatch) -> None:
        self.ran: list[str] = []
        self.capturing: list[bool] = []
        self.failure: Exception | None = None
        fake = self

        class Graph:
            def replay(self) -> None:
                fake.ran.append("replay")

        class Stream:
            def wait_stream(self, other) -> None:
                pass

        @contextlib.contextmanager
        def graph(_, pool=None):
            self.capturing.append(True)
            try:
                yield
                if self.failure is not None:
                    raise self.failure
            finally:
                self.capturing.pop()

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", lambda _: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)

    def run(self) -> str:
        if not self.capturing:
            self.ran.append("run")
        return "captured" if self.capturing else "warm"


@pytest.mark.parametrize("commits", [True, False], ids=["commits", "pure"])
def test_a_pass_that_commits_runs_once_on_the_call_that_captures_it(commits, monkeypatch):
    """On CUDA a pass's first call runs it, then captures it (a capture runs nothing). One
    that commits as it runs (a plain step's GDN states) returns that run's outputs and does
    not replay the capture too: its states are stepped once. Later calls replay."""
    cuda = FakeCUDA(monkeypatch)
    step = StaticPass(cuda.run, {}, graphs=True, commits=commits)
    assert step() == ("warm" if commits else "captured")
    assert cuda.ran == (["run"] if commits else ["run", "replay"])
    cuda.ran.clear()
    assert step() == "captured" and cuda.ran == ["replay"]


@pytest.mark.parametrize("commits", [True, False], ids=["commits", "pure"])
def test_a_pass_cuda_cannot_capture_runs_eagerly_from_then_on(commits, monkeypatch, caplog):
    """A capture that fails (an op CUDA cannot capture) costs nothing: the call returns the
    run before it, once, and later calls run eagerly; the failure is logged once. Running out
    of memory while capturing is raised."""
    cuda = FakeCUDA(monkeypatch)
    cuda.failure = RuntimeError("operation not permitted when stream is capturing")
    step = StaticPass(cuda.run, {}, graphs=True, commits=commits)
    assert step() == "warm" and cuda.ran == ["run"]
    assert step() == "warm" and cuda.ran == ["run", "run"]
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "runs eagerly" in caplog.records[0].getMessage()
    cuda.failure = torch.cuda.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        StaticPass(cuda.run, {}, graphs=True, commits=commits)()
