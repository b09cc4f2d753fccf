"""The scheduler (engine/scheduler.py) is lossless: each sequence's tokens equal its solo generate().

    python -m pytest -q tests/engine/test_batching.py

Tiny random dense and hybrid pairs in float64 (no logit near-ties): sequences of every method,
greedy and seeded sampling, under a grammar and with the prefix cache on, run side by side in
one batched pass a step, joining while others decode or prefill, leaving and cancelled midway;
each one's output is compared with the same request run alone through `generate`.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import replace

import pytest
import torch

from engine import budgets, kv_blocks
from engine.decode import KEEP_PIECES, GenerationConfig, generate
from engine.grammar import Constraint
from engine.kv_blocks import KVBlockPool
from engine.memory_plan import is_out_of_memory
from engine.models import common
from engine.prefix_cache import PrefixCache, has_states
from engine.scheduler import Scheduler
from tests.helpers.batched_requests import (
    MIXED,
    NEW,
    PAGE,
    POOL,
    SCHEMA,
    SLOT,
    Collector,
    configs,
    drain,
    prompts,
    scheduler,
    solo,
)
from tests.helpers.tiny_grammar import STOP, char_tokenizer
from tests.helpers.tiny_pairs import KINDS, load_tiny_pair

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    return load_tiny_pair(
        tmp_path_factory.mktemp(request.param), request.param, dtype=torch.float64
    )


def test_sequences_side_by_side_equal_their_solo_runs(pair):
    cases = list(zip(prompts(pair, [5, 40, 9, 70, 3, 22]), configs(), strict=True))
    sched, got = scheduler(pair, slots=6, tokens=48), Collector()
    widths = []
    sched.on_pass = lambda sequences, tokens: widths.append((sequences, tokens))
    for index, (prompt, cfg) in enumerate(cases):
        sched.add(got.request(index, prompt, cfg))
    drain(sched)
    for index, (prompt, cfg) in enumerate(cases):
        assert got.output(index) == solo(pair, prompt, cfg), MIXED[index]
    assert max(sequences for sequences, _ in widths) == 6  # they did share passes
    assert max(tokens for _, tokens in widths) <= 48 + 6 * 16  # prefill pieces kept the budget


def test_drafted_trees_side_by_side_equal_their_solo_runs(pair):
    """The trees of a batched step's drafts (their top-k read back together, by budget) are
    each sequence's own: round by round those of its solo run."""
    drafting = [("ddtree", 6), ("ddtree", 3), ("ddtree", 6), ("linear", 1), ("ddtree", 6)]
    cfgs = [GenerationConfig(m, b, max_new_tokens=NEW, trace=True) for m, b in drafting]
    cases = list(zip(prompts(pair, [5, 40, 9, 70, 14], seed=4), cfgs, strict=True))
    sched, got = scheduler(pair, slots=len(cases), tokens=48), Collector()
    for index, (prompt, cfg) in enumerate(cases):
        sched.add(got.request(index, prompt, cfg))
    drain(sched)
    for index, (prompt, cfg) in enumerate(cases):
        alone = generate(*pair, prompt, cfg).rounds
        assert got.finished[index].result.rounds == alone, drafting[index]


def test_requests_join_while_others_decode_and_wait_for_a_slot(pair):
    cases = list(zip(prompts(pair, [12, 30, 7, 50, 4], seed=1), configs(), strict=False))
    sched, got = scheduler(pair, slots=2, tokens=20), Collector()
    sched.add(got.request(0, *cases[0]))
    for _ in range(3):  # the first is decoding when the others arrive
        sched.step()
    for index in range(1, len(cases)):
        sched.add(got.request(index, *cases[index]))
        sched.step()
        assert len(sched.running) <= 2
    drain(sched)
    for index, (prompt, cfg) in enumerate(cases):
        assert got.output(index) == solo(pair, prompt, cfg)


def recorded_passes(pair, monkeypatch) -> list[list[str]]:
    """The target's batched passes as they run: each a list of "prefill" / "round" segments."""
    target, _ = pair
    passes, batched_pass = [], target.forward_batch

    def forward_batch(segments, hidden_layers=()):
        passes.append(["prefill" if segment.extend else "round" for segment in segments])
        return batched_pass(segments, hidden_layers)

    monkeypatch.setattr(target, "forward_batch", forward_batch)
    return passes


def test_a_sequence_alone_decodes_by_generates_passes_and_batches_when_another_joins(
    pair, monkeypatch
):
    passes = recorded_passes(pair, monkeypatch)
    sched = scheduler(pair, slots=1)
    assert "cuda_graphs" not in sched.options  # one slot: its solo rounds may capture graphs
    assert scheduler(pair, slots=2).options["cuda_graphs"] is False  # several: not per slot
    cases = list(zip(prompts(pair, [12, 9], seed=2), configs()[1:3], strict=True))
    sched, got = scheduler(pair, slots=2, tokens=64), Collector()
    sched.add(got.request(0, *cases[0]))
    for _ in range(4):  # its prefill, then rounds alone: generate()'s static passes
        sched.step()
    assert passes == [["prefill"]]
    assert sched.passes == 4  # each round alone is still a pass
    sched.add(got.request(1, *cases[1]))
    drain(sched)
    assert passes[1] == ["round", "prefill"]  # the newcomer shares the running one's pass
    assert ["round", "round"] in passes
    for index, (prompt, cfg) in enumerate(cases):
        assert got.output(index) == solo(pair, prompt, cfg)


@pytest.mark.parametrize("drafts", [True, False], ids=["drafts-pay", "drafts-miss"])
def test_auto_alone_drafts_by_generates_passes_or_batches_its_bonus_alone(
    pair, drafts, monkeypatch
):
    """Alone, an `auto` sequence its budgets tell to draft verifies its whole tree by
    generate()'s static passes (no batched round pass, as `ddtree` alone); one told not to
    decodes its bonus alone in the batched pass. Its tokens are plain decoding's either way."""
    passes = recorded_passes(pair, monkeypatch)
    cfg = GenerationConfig("auto", 15, max_new_tokens=NEW, prefill_chunk=16)
    prompt = prompts(pair, [6], seed=3)[0]
    sched, got = scheduler(pair, slots=1), Collector()
    monkeypatch.setattr(sched.budgets, "drafting_alone", lambda acceptance: drafts)
    sched.add(got.request(0, prompt, cfg))
    drain(sched)
    assert got.output(0) == solo(pair, prompt, replace(cfg, method="ar"))
    chosen = got.finished[0].result.budgets
    if drafts:  # the last round has no room to draft: its bonus alone, batched
        assert passes == [["prefill"], ["round"]] and min(chosen[:-1]) > 0 == chosen[-1]
    else:
        assert set(map(tuple, passes[1:])) == {("round",)} and set(chosen) == {0}
    assert (sched.budgets.solo_round is not None) is drafts  # a solo round was timed
    # and a batched round of its bonus alone (drafting, its only one was its last: untimed)
    assert (sched.budgets.bonus_round is not None) is not drafts


@pytest.mark.parametrize("drafts", [True, False], ids=["drafted", "bonus-alone"])
def test_a_lone_auto_round_is_timed_to_the_next_step(pair, drafts, monkeypatch):
    """What a lone round costs beside its passes (behind a server: its work between steps)
    counts: its seconds run from its step's start to the next step's."""
    cfg = GenerationConfig("auto", 15, max_new_tokens=NEW, prefill_chunk=16)
    sched, got = scheduler(pair, slots=1), Collector()
    monkeypatch.setattr(sched.budgets, "drafting_alone", lambda acceptance: drafts)
    sched.add(got.request(0, prompts(pair, [6], seed=3)[0], cfg))
    while not sched.idle:
        sched.step()
        time.sleep(0.02)
    timed = sched.budgets.solo_round if drafts else sched.budgets.bonus_round
    assert timed >= 0.02


def test_a_cancelled_sequence_leaves_and_the_others_are_unchanged(pair):
    cases = list(zip(prompts(pair, [10, 60, 8], seed=2), configs()[:3], strict=True))
    sched, got = scheduler(pair, slots=3, tokens=16), Collector()
    stop = {"decoding": False, "prefilling": False}
    sched.add(got.request(0, *cases[0], should_stop=lambda: stop["decoding"]))
    sched.add(got.request(1, *cases[1], should_stop=lambda: stop["prefilling"]))
    sched.add(got.request(2, *cases[2]))
    for _ in range(3):
        sched.step()
    assert got.streamed[0] and not got.streamed[1]  # one decoding, one still prefilling
    stop["decoding"] = stop["prefilling"] = True
    drain(sched)
    assert got.finished[0].result.finish_reason == "cancelled"
    assert got.streamed[0] == solo(pair, *cases[0])[: len(got.streamed[0])]
    assert got.finished[1].result is None and got.finished[1].error is None
    assert got.output(2) == solo(pair, *cases[2])
    assert len(sched.free) == 3  # every slot came back


def test_grammar_constrained_sequences_share_passes(pair):
    vocab = pair[0].lm_head.weight.shape[0]
    constraint = Constraint.from_json_schema(char_tokenizer(vocab), SCHEMA)
    cfgs = configs(constraint=constraint, stop_token_ids=(STOP,))[:4]
    cases = list(zip(prompts(pair, [6, 20, 9, 14], seed=3), cfgs, strict=True))
    sched, got = scheduler(pair, slots=4), Collector()
    for index, case in enumerate(cases):
        sched.add(got.request(index, *case))
    drain(sched)
    for index, (prompt, cfg) in enumerate(cases):
        assert got.output(index) == solo(pair, prompt, cfg)


def test_with_the_prefix_cache_a_next_turn_resumes_and_decodes_the_same(pair):
    target, drafter = pair
    prefix = PrefixCache(1 << 30, recurrent=has_states(target.new_cache(8)))
    first, other = prompts(pair, [40, 25], seed=4)
    cfg = configs()[1]  # greedy ddtree
    sched, got = scheduler(pair, slots=2, tokens=24, prefix=prefix), Collector()
    sched.add(got.request(0, first, cfg))
    sched.add(got.request(1, other, cfg))
    drain(sched)
    second = first + got.output(0)[:-1] + [5, 6, 7]  # the next turn extends the first
    sched.add(got.request(2, second, cfg))
    sched.add(got.request(3, other, cfg))  # the same prompt again
    drain(sched)
    assert got.finished[2].result.cached_tokens > len(first)
    assert got.finished[3].result.cached_tokens > 0
    assert got.output(2) == solo(pair, second, cfg)
    assert got.output(3) == got.output(1) == solo(pair, other, cfg)


def test_a_request_that_cannot_fit_finishes_with_the_error_at_once(pair):
    sched, got = scheduler(pair, slots=1), Collector()
    sched.add(got.request(0, [3] * (SLOT + 1), configs()[0]))
    assert isinstance(got.finished[0].error, ValueError)
    assert sched.idle


def test_an_out_of_memory_step_empties_the_prefix_cache_and_retries_once(pair, monkeypatch):
    target, drafter = pair
    prefix = PrefixCache(1 << 30, recurrent=has_states(target.new_cache(8)))
    sched, got = scheduler(pair, slots=2, prefix=prefix), Collector()
    first, second = prompts(pair, [20, 9], seed=5)
    cfg = configs()[0]
    sched.add(got.request(0, first, cfg))
    drain(sched)
    assert prefix.used_bytes
    real, failures = target.forward_batch, [torch.OutOfMemoryError("CUDA out of memory")]

    def failing_once(*args, **kwargs):
        if failures:
            raise failures.pop()
        return real(*args, **kwargs)

    monkeypatch.setattr(target, "forward_batch", failing_once)
    sched.add(got.request(1, second, cfg))
    drain(sched)
    assert not failures and got.output(1) == solo(pair, second, cfg)
    assert prefix.lookup(first, drafted=False).position == 0  # the first's entries are gone


def test_logprobs_beside_other_sequences_equal_their_solo_runs(pair):
    cfgs = [replace(cfg, logprobs=2, prompt_logprobs=1) for cfg in configs()[:3]]
    cases = list(zip(prompts(pair, [9, 30, 5], seed=6), cfgs, strict=True))
    sched, got = scheduler(pair, slots=3, tokens=16), Collector()
    for index, case in enumerate(cases):
        sched.add(got.request(index, *case))
    drain(sched)
    for index, (prompt, cfg) in enumerate(cases):
        alone = generate(*pair, prompt, cfg)
        result = got.finished[index].result
        assert got.output(index) == alone.output_ids
        assert [t.logprob for t in result.logprobs] == pytest.approx(
            [t.logprob for t in alone.logprobs], abs=1e-9
        )
        assert len(result.prompt_logprobs) == len(prompt)


# Contiguous caches (one attention call a sequence), paged ones over one pool (a padded batch on
# the CPU), and the same forced through CUDA's one paged launch.
DRAFT_CACHES = ("contiguous", "paged", "one launch")


@pytest.mark.parametrize("caches", DRAFT_CACHES)
def test_the_drafters_batched_pass_equals_its_drafts_one_by_one(pair, caches, monkeypatch):
    target, drafter = pair
    if caches == "one launch":
        monkeypatch.setattr(common, "ONE_LAUNCH_DEVICES", ("cpu",))
    width = len(drafter.target_layer_ids) * target.config.hidden_size
    generator = torch.Generator().manual_seed(7)
    lengths, histories = [3, 1, 9], [0, 5, 12]
    blocks = None
    if caches != "contiguous":  # small blocks: each sequence's keys span several
        blocks = KVBlockPool(drafter.kv_layout(), capacity=64, block_tokens=4)
    copies = [[drafter.new_cache(64, blocks) for _ in lengths] for _ in range(2)]
    items = []
    for index, (count, history) in enumerate(zip(lengths, histories, strict=True)):
        past = torch.randn(history, width, generator=generator, dtype=torch.float64)
        for made in copies:
            drafter.append_context(made[index], past)
        context = torch.randn(count, width, generator=generator, dtype=torch.float64)
        items.append((context, 3 + index))
    alone = [
        drafter.draft(target, cache, context, bonus)
        for cache, (context, bonus) in zip(copies[0], items, strict=True)
    ]
    batch = [
        (cache, context, bonus) for cache, (context, bonus) in zip(copies[1], items, strict=True)
    ]
    together = drafter.draft_batch(target, batch)
    for one, other, a, b in zip(alone, together, copies[0], copies[1], strict=True):
        torch.testing.assert_close(other, one, rtol=0, atol=1e-9)
        assert a.length == b.length
        for layer in range(drafter.config.num_hidden_layers):
            for mine, theirs in zip(committed_kv(b, layer), committed_kv(a, layer), strict=True):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)


def committed_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache's committed K and V of `layer`, paged or contiguous."""
    if hasattr(cache, "keys"):
        return cache.keys(layer, cache.length)
    return cache.k[layer, : cache.length], cache.v[layer, : cache.length]


def test_attention_in_one_paged_launch_decodes_as_segment_by_segment(pair, monkeypatch):
    """What CUDA runs (every segment's attention in one paged launch a layer,
    kv_blocks.PagedSequences), forced on the CPU: each sequence still equals its solo run."""
    launches = []
    launch = kv_blocks.paged_tree_attention

    def counted(q, k, v, tables, *args):
        launches.append(tables.shape[0])
        return launch(q, k, v, tables, *args)

    monkeypatch.setattr(common, "ONE_LAUNCH_DEVICES", ("cpu",))
    monkeypatch.setattr(kv_blocks, "paged_tree_attention", counted)
    cases = list(zip(prompts(pair, [5, 40, 9, 30], seed=8), configs()[:4], strict=True))
    sched, got = scheduler(pair, slots=4, tokens=32), Collector()
    for index, case in enumerate(cases):
        sched.add(got.request(index, *case))
    drain(sched)
    for index, (prompt, cfg) in enumerate(cases):
        assert got.output(index) == solo(pair, prompt, cfg)
    assert max(launches) == 4


def scripted_costs(sched: Scheduler, monkeypatch, period: int = 12, scale: float = 20.0) -> None:
    """The scheduler's cost model fed a cost that moves every `period` passes from tokens
    that cost nothing to tokens that pay for a tree's likelier nodes only, to tokens dearer
    than they bring, and round again, with cheap drafts; a random pair's drafter is accepted
    almost never, so the model is told its drafts are (a calibration of `scale`, 20x by
    default): `auto`'s budgets must follow the cost, whole trees, parts of trees and none
    (the real allocator, its fits fed these seconds)."""
    monkeypatch.setattr(budgets.Acceptance, "scale", scale)
    passes = itertools.count()
    observe_pass, observe_draft = sched.budgets.observe_pass, sched.budgets.observe_draft

    def pass_seconds(tokens: int, trees: int, _: float) -> None:
        per_token = (1e-7, 2e-4, 0.02)[next(passes) // period % 3]
        observe_pass(tokens, trees, 0.001 + 1e-5 * trees + per_token * tokens)

    sched.budgets.observe_pass = pass_seconds
    sched.budgets.observe_draft = lambda sequences, _: observe_draft(sequences, 1e-6 * sequences)
    auto_nodes = sched._auto_nodes  # the draft's own seconds too: the machine's load never counts
    monkeypatch.setattr(
        sched, "_auto_nodes", lambda rounds, trees, _: auto_nodes(rounds, trees, 1e-6 * len(trees))
    )


@pytest.mark.parametrize("grammar", [False, True], ids=["plain", "grammar"])
def test_auto_budgets_vary_and_each_output_equals_its_solo_ar_run(pair, grammar, monkeypatch):
    """`auto` chooses each round's node count (0 included) for the batch: only how many of
    its tree's nodes are verified changes, so its greedy tokens are plain decoding's."""
    changes = {}
    if grammar:
        vocab = pair[0].lm_head.weight.shape[0]
        constraint = Constraint.from_json_schema(char_tokenizer(vocab), SCHEMA)
        changes = {"constraint": constraint, "stop_token_ids": (STOP,)}
    cfg = GenerationConfig("auto", 15, max_new_tokens=32, prefill_chunk=16, **changes)
    cases = prompts(pair, [5, 40, 9, 30], seed=9)
    sched, got = scheduler(pair, slots=4, tokens=48), Collector()
    scripted_costs(sched, monkeypatch)
    for index, prompt in enumerate(cases):
        sched.add(got.request(index, prompt, cfg))
    drain(sched)
    chosen = []
    for index, prompt in enumerate(cases):
        assert got.output(index) == solo(pair, prompt, replace(cfg, method="ar"))
        budgets = got.finished[index].result.budgets
        assert len(budgets) == len(got.finished[index].result.acceptance_lengths)
        chosen += budgets
    assert 0 in chosen and max(chosen) >= (1 if grammar else 8), chosen  # a random pair's
    assert len(set(chosen)) >= (2 if grammar else 3), chosen  # grammar-valid trees are small


def test_a_sequence_skipping_drafts_keeps_its_features_in_pieces_joined_when_read(
    pair, monkeypatch
):
    """An `auto` sequence that does not draft (a busy batch) keeps each round's drafter
    features as a piece of their own: its prompt's are not copied round after round (at 27B a
    3,300-token prompt's are ~160 MiB). A round's piece is a view of its step's rows gathered
    for every sequence; every KEEP_PIECES rounds' are joined into a piece holding only theirs.
    Read, they join into the target's features of every token committed since its last draft,
    in order; and its output is plain decoding's."""
    target, drafter = pair
    cfg = GenerationConfig("auto", 15, max_new_tokens=NEW, prefill_chunk=16)
    cases = prompts(pair, [20, 33], seed=5)
    sched, got = scheduler(pair, slots=2), Collector()

    def never(asked, _base):
        return [False] * len(asked)

    monkeypatch.setattr(sched.budgets, "drafting", never)
    for index, prompt in enumerate(cases):
        sched.add(got.request(index, prompt, cfg))
    while sched.waiting or any(active.prefilling for active in sched.running):
        sched.step()
    before = [active.seq._kept[0] for active in sched.running]
    for _ in range(KEEP_PIECES + 1):
        sched.step()
    for active, prompt, kept in zip(sched.running, cases, before, strict=True):
        seq = active.seq
        assert seq._kept[0] is kept  # the prompt's, uncopied
        own = [piece.untyped_storage().nbytes() == piece.nbytes for piece in seq._kept[1:]]
        # the rounds' pieces: each KEEP_PIECES joined into one holding only their rows, then
        # the views of the steps' gathered rows since
        assert own == [True] * own.count(True) + [False] * own.count(False), own
        assert own.count(True) >= 1 and 0 < own.count(False) < KEEP_PIECES
        assert seq._kept[1].shape[0] == KEEP_PIECES  # a plain round commits one token
        assert seq.context_rows == len(seq.committed) >= len(prompt) + KEEP_PIECES + 1
        layers = tuple(drafter.target_layer_ids)
        ids = torch.tensor(seq.committed)
        _, features = target.forward(ids, target.new_cache(SLOT), None, layers)
        torch.testing.assert_close(seq.context, features)
        assert len(seq._kept) == 1  # joined once
    monkeypatch.undo()
    drain(sched)
    for index, prompt in enumerate(cases):
        assert got.output(index) == solo(pair, prompt, replace(cfg, method="ar"))


@pytest.mark.parametrize("cached", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_a_sequences_features_are_joined_at_its_end_only_to_be_stored(pair, cached, monkeypatch):
    """An `auto` sequence that did not draft ends holding its features in pieces: they are
    joined (a copy of every token's) only when its prefix cache stores them for the drafter."""
    target, _ = pair
    prefix = PrefixCache(1 << 30, recurrent=has_states(target.new_cache(8))) if cached else None
    sched, got = scheduler(pair, slots=2, prefix=prefix), Collector()
    monkeypatch.setattr(sched.budgets, "drafting", lambda asked, _: [False] * len(asked))
    cfg = GenerationConfig("auto", 15, max_new_tokens=NEW, prefill_chunk=16)
    for index, prompt in enumerate(prompts(pair, [20, 33], seed=5)):
        sched.add(got.request(index, prompt, cfg))
    sched.step()
    sequences = [active.seq for active in sched.running]
    drain(sched)
    assert [len(seq._kept) == 1 for seq in sequences] == [cached, cached]


def test_an_auto_round_without_a_draft_leaves_its_trees_tokens_to_a_prefill(pair, monkeypatch):
    """Who drafts is decided before the step takes its blocks: an `auto` round without a draft
    holds one token of the pass, not its widest tree. Beside two such rounds a prompt prefills
    the rest of each 32-token pass (their trees counted, 2 x 16, it would wait for them)."""
    target, _ = pair
    cfg = GenerationConfig("auto", 15, max_new_tokens=NEW)
    sched, got = scheduler(pair, slots=3, tokens=32), Collector()
    monkeypatch.setattr(sched.budgets, "drafting", lambda asked, _base: [False] * len(asked))
    cases = prompts(pair, [6, 7, 60], seed=3)
    for index, prompt in enumerate(cases[:2]):
        sched.add(got.request(index, prompt, cfg))
    while sched.waiting or any(active.prefilling for active in sched.running):
        sched.step()
    passes, batched_pass = [], target.forward_batch

    def forward_batch(segments, hidden_layers=()):
        passes.append([(segment.extend, segment.ids.shape[0]) for segment in segments])
        return batched_pass(segments, hidden_layers)

    monkeypatch.setattr(target, "forward_batch", forward_batch)
    sched.add(got.request(2, cases[2], cfg))
    sched.step()
    assert passes == [[(False, 1), (False, 1), (True, 30)]]
    drain(sched)
    for index, prompt in enumerate(cases):
        assert got.output(index) == solo(pair, prompt, replace(cfg, method="ar"))


def test_auto_budgets_count_the_prefills_that_wait_on_the_step(pair, monkeypatch):
    """A prompt prefilling beside `auto` rounds waits on the step as they do: the choice of
    who drafts sees its piece's tokens and its sequence (a tree drafted there delays every
    prefill beside it, not only its own sequence's neighbours)."""
    cfg = GenerationConfig("auto", 15, max_new_tokens=NEW)
    sched, got = scheduler(pair, slots=4, tokens=32), Collector()
    seen = []

    def drafting(asked, base):
        seen.append(base)
        return [False] * len(asked)

    monkeypatch.setattr(sched.budgets, "drafting", drafting)
    cases = prompts(pair, [6, 7, 60, 5], seed=4)
    for index, prompt in enumerate(cases[:2]):
        sched.add(got.request(index, prompt, cfg))
    while sched.waiting or any(active.prefilling for active in sched.running):
        sched.step()
    seen.clear()
    sched.step()
    assert seen == [budgets.Baseline(tokens=2, trees=0, sequences=2)]  # nothing prefills
    for index in (2, 3):
        sched.add(got.request(index, cases[index], cfg))
    seen.clear()
    sched.step()  # two bonus tokens, the two prompts' 65 in the 30 left
    assert seen == [budgets.Baseline(tokens=32, trees=0, sequences=4)]
    drain(sched)
    for index, prompt in enumerate(cases):
        assert got.output(index) == solo(pair, prompt, replace(cfg, method="ar"))


def test_a_seeded_sampled_auto_request_verifies_its_cap_and_repeats(pair, monkeypatch):
    """Sampled, a round's node count changes how the sequence's generator is drawn: a seeded
    `auto` request keeps its cap every round, so its tokens are ddtree's with that seed while
    the unseeded ones beside it are cut. Their drafts are taken at their worth (a calibration
    of 1): beside the seeded request's whole tree even the dear passes' rate leaves a node at
    20x worth verifying, so at 20x their budgets were the cap too, and the test held only when
    an unseeded request's last round (no room for a draft) came before it ran alone."""
    cfg = GenerationConfig("auto", 15, max_new_tokens=NEW, prefill_chunk=16, temperature=1.0)
    cases = prompts(pair, [5, 40, 9], seed=4)
    sched, got = scheduler(pair, slots=3, tokens=48), Collector()
    scripted_costs(sched, monkeypatch, scale=1.0)
    for index, prompt in enumerate(cases):
        sched.add(got.request(index, prompt, replace(cfg, seed=None if index else 7)))
    drain(sched)
    assert got.output(0) == solo(pair, cases[0], replace(cfg, method="ddtree", seed=7))
    seeded, *unseeded = (got.finished[index].result.budgets for index in range(3))
    assert set(seeded[:-1]) == {15}
    assert all(min(budgets[:-1]) < 15 for budgets in unseeded), unseeded


# -- preemption: an oversubscribed KV pool -------------------------------------------------


def preempting(pair, got: Collector, slots: int = 6, **extra) -> tuple[Scheduler, list[int]]:
    """A scheduler over a POOL-token pool, and the tokens each preempted sequence had
    streamed when it was preempted (it is at the head of the queue then)."""
    sched = scheduler(pair, slots, kv_tokens=POOL, **extra)
    streamed: list[int] = []
    sched.on_preempt = lambda: streamed.append(len(sched.waiting[0].run.out.ids))
    return sched, streamed


@pytest.mark.parametrize("cached", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_an_oversubscribed_pool_preempts_and_every_output_equals_its_solo_run(pair, cached):
    target, drafter = pair
    block_bytes = sum(model.kv_layout().block_bytes(PAGE) for model in pair)
    budget = 8 * block_bytes  # its share of the pool: 8 blocks more
    prefix = PrefixCache(budget, recurrent=has_states(target.new_cache(8)), block_tokens=PAGE)
    cases = list(zip(prompts(pair, [5, 40, 9, 70, 3, 22], seed=9), configs(), strict=True))
    got = Collector()
    sched, streamed = preempting(pair, got, tokens=24, prefix=prefix if cached else None)
    for index, case in enumerate(cases):
        sched.add(got.request(index, *case))
    drain(sched, limit=3000)
    for index, (prompt, cfg) in enumerate(cases):
        assert got.output(index) == solo(pair, prompt, cfg), MIXED[index]  # streamed once each
    assert sched.preemptions >= 3 and len(streamed) == sched.preemptions
    assert max(streamed) > 1  # one was preempted mid-stream, after rounds
    assert len(sched.free) == 6
    if not cached:  # every block came back
        assert not any(sched.free[0].target_blocks.refs)
    if not cached:
        assert sched.resumed["cached"] == 0


def test_an_auto_sequence_counts_the_rounds_it_ran_without_a_draft_not_its_preempted_ones(
    pair, monkeypatch
):
    """An `auto` round that keeps its bonus alone brings its sequence's probe one round
    nearer; a round planned for a sequence that the step then preempts never ran, and does
    not (else a preempted sequence probes early, its wait counted in rounds it never ran)."""
    sched, got = scheduler(pair, slots=6, kv_tokens=POOL, tokens=24), Collector()
    monkeypatch.setattr(sched.budgets, "drafting", lambda asked, _base: [False] * len(asked))
    monkeypatch.setattr(sched.budgets, "drafting_alone", lambda _acc: False)
    ran, acceptances = collections.Counter(), {}  # by request: rounds that ran and could draft
    plan_rounds = sched._rounds

    def counting(rounds, draft_ids):
        for active, rooms in rounds:
            acceptances[id(active.request)] = active.acceptance
            ran[id(active.request)] += active.seq.may_draft(*rooms)
        return plan_rounds(rounds, draft_ids)

    monkeypatch.setattr(sched, "_rounds", counting)
    cfg = GenerationConfig("auto", 15, max_new_tokens=NEW)
    requests = [got.request(i, p, cfg) for i, p in enumerate(prompts(pair, [5, 40, 9, 30], 9))]
    for request in requests:
        sched.add(request)
    drain(sched, limit=3000)
    assert sched.preemptions >= 1
    skipped = [acceptances[id(request)].skipped for request in requests]
    assert skipped == [ran[id(request)] for request in requests]
    assert min(skipped) > 0


def test_preempted_sequences_keep_their_grammar_and_logprobs(pair):
    vocab = pair[0].lm_head.weight.shape[0]
    constraint = Constraint.from_json_schema(char_tokenizer(vocab), SCHEMA)
    grammar = configs(constraint=constraint, stop_token_ids=(STOP,))[:3]
    scored = [replace(cfg, logprobs=2, prompt_logprobs=1) for cfg in configs()[3:]]
    cases = list(
        zip(prompts(pair, [30, 20, 44, 9, 50, 12], seed=10), grammar + scored, strict=True)
    )
    got = Collector()
    sched, streamed = preempting(pair, got, tokens=16)
    for index, case in enumerate(cases):
        sched.add(got.request(index, *case))
    drain(sched, limit=3000)
    assert sched.preemptions >= 2 and max(streamed) > 1
    for index, (prompt, cfg) in enumerate(cases):
        alone = generate(*pair, prompt, cfg)
        result = got.finished[index].result
        assert got.output(index) == alone.output_ids
        if cfg.logprobs:
            assert [t.logprob for t in result.logprobs] == pytest.approx(
                [t.logprob for t in alone.logprobs], abs=1e-9
            )
            assert [p and p.logprob for p in result.prompt_logprobs] == pytest.approx(
                [p and p.logprob for p in alone.prompt_logprobs], abs=1e-9
            )


def test_a_preempted_sequence_cancelled_while_it_waits_ends_with_what_it_streamed(pair):
    cases = list(zip(prompts(pair, [40, 60, 50, 30], seed=11), configs()[:4], strict=True))
    got, stop = Collector(), {"now": False}
    sched, streamed = preempting(pair, got, slots=4, tokens=24)
    requests = [
        got.request(index, *case, should_stop=lambda: stop["now"])
        for index, case in enumerate(cases)
    ]
    for request in requests:
        sched.add(request)
    for _ in range(500):  # until one that had streamed tokens waits
        sched.step()
        if streamed and streamed[-1]:
            break
    assert streamed and streamed[-1]
    index = next(i for i, r in enumerate(requests) if r is sched.waiting[0].request)
    stop["now"] = True
    drain(sched)
    result = got.finished[index].result
    assert result.finish_reason == "cancelled" and result.output_ids == got.streamed[index]
    assert result.output_ids == solo(pair, *cases[index])[: len(result.output_ids)]
    assert len(sched.free) == 4


def test_a_sequence_that_cannot_fit_the_pool_alone_fails_out_of_memory(pair):
    got = Collector()
    sched, _ = preempting(pair, got, slots=2, tokens=32)
    too_long, short = prompts(pair, [POOL + 8, 9], seed=12)
    sched.add(got.request(0, too_long, configs()[0]))
    sched.add(got.request(1, short, configs()[1]))
    drain(sched)
    assert is_out_of_memory(got.finished[0].error)
    assert got.output(1) == solo(pair, short, configs()[1])


def test_a_preempted_sequence_resumes_all_it_committed_from_the_prefix_cache(pair):
    """Preempted between rounds with room in the prefix cache: readmitted, it restores every
    token it had committed (nothing recomputed) and decodes on as alone."""
    target, _ = pair
    prefix = PrefixCache(1 << 30, recurrent=has_states(target.new_cache(8)), block_tokens=PAGE)
    sched, got = scheduler(pair, slots=2, prefix=prefix, kv_tokens=SLOT), Collector()
    prompt, cfg = prompts(pair, [30], seed=13)[0], configs()[3]  # sampled ddtree
    sched.add(got.request(0, prompt, cfg))
    while len(got.streamed[0]) < 4:
        sched.step()
    active = sched.running[0]
    committed = len(active.seq.committed)
    sched._requeue(active, counted=True)
    drain(sched)
    assert sched.preemptions == 1
    assert sched.resumed == {"recomputed": 0, "cached": committed}
    assert got.output(0) == solo(pair, prompt, cfg)
