"""engine/budgets.py: the cost fit, the acceptance model and the budget choice of `auto`.

    python -m pytest -q tests/engine/test_budgets.py

The choice is checked against brute force (every combination of node counts) on small cases;
the fit against samples of a known linear cost; the chooser against the changes a batch sees
(dearer tokens, a sequence whose drafts miss, a sequence turned off and probing again).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine.budgets import (
    CHOICE_PASSES,
    PROBE_AFTER,
    PROBE_MAX,
    Acceptance,
    Baseline,
    Budgets,
    Candidate,
    LinearCost,
    choose,
    fairness,
)


def objective(candidates, counts, sequences, base_seconds, per_token) -> float:
    """The step's sum of log(tokens a second), the others' fixed tokens left out."""
    taken = [(c, k) for c, k in zip(candidates, counts, strict=True) if k]
    tokens = sum(np.log1p(c.gains[:k].sum()) for c, k in taken)
    return tokens - sequences * np.log(
        base_seconds + sum(per_token * k + c.entry for c, k in taken)
    )


def falling(size: int, rng) -> np.ndarray:
    return np.sort(rng.uniform(0, 1, size))[::-1]


@pytest.mark.parametrize("seed", range(60))
def test_the_choice_is_the_fairest_of_all_combinations(seed):
    """Random candidates, and (every third seed) three alike, whose trees may pay only all
    together: a choice that moves one sequence at a time from none would stop at none."""
    rng = np.random.default_rng(seed)
    candidates = [Candidate(falling(5, rng), rng.uniform(0, 0.01)) for _ in range(3)]
    if seed % 3 == 0:
        candidates = [candidates[0]] * 3
    sequences, base_seconds = 3 + rng.integers(0, 4), rng.uniform(0.002, 0.02)
    per_token = rng.uniform(0, 0.004)
    counts = choose(candidates, sequences, base_seconds, per_token)
    best = max(
        objective(candidates, combo, sequences, base_seconds, per_token)
        for combo in itertools.product(range(6), repeat=3)
    )
    assert objective(candidates, counts, sequences, base_seconds, per_token) == pytest.approx(best)
    assert fairness(candidates, counts, sequences, base_seconds, per_token) == pytest.approx(best)


def test_alone_the_fairest_choice_is_the_fastest():
    """One sequence: log(tokens) - log(seconds) is the log of its rate, so the choice is the
    count of the most tokens a second."""
    gains = np.array([0.9, 0.7, 0.5, 0.3, 0.1, 0.05])
    for per_token in (1e-4, 1e-3, 3e-3):
        rates = [(1 + gains[:k].sum()) / (0.01 + per_token * k) for k in range(7)]
        assert choose([Candidate(gains)], 1, 0.01, per_token) == [int(np.argmax(rates))]


def test_a_tree_that_pays_for_itself_alone_may_not_pay_for_the_time_it_costs_five_others():
    """A tree that doubles its sequence's tokens for 1.45 times the step's seconds: worth it
    alone, not beside five others whose steps it slows as much (0.69 < 6 * 0.37); one that
    brings twelve more tokens for the same seconds is worth it there too."""
    doubling = Candidate(np.full(15, 1 / 15), entry=0.003)  # 15 nodes: 4.5 ms on 10
    assert choose([doubling], 1, 0.01, 0.0001) == [15]
    assert choose([doubling], 6, 0.01, 0.0001) == [0]
    strong = Candidate(np.full(15, 0.8), entry=0.003)
    assert choose([strong], 6, 0.01, 0.0001) == [15]


def test_dearer_tokens_never_get_more_nodes_and_free_ones_get_all():
    gains = np.array([0.9, 0.7, 0.5, 0.3, 0.1, 0.05])
    candidates = [Candidate(gains, 0.001), Candidate(gains * 0.5, 0.001)]
    totals = [sum(choose(candidates, 2, 0.01, cost)) for cost in (0, 1e-4, 1e-3, 3e-3, 1e-2)]
    assert totals[0] == 12  # tokens that cost nothing: every node
    assert totals == sorted(totals, reverse=True)
    assert totals[-1] == 0  # a token dearer than what it brings: plain decoding
    assert len(set(totals)) >= 3


def test_an_entry_that_costs_more_than_the_tree_brings_means_no_tree():
    gains = np.array([0.5, 0.3])
    assert choose([Candidate(gains, 0.0)], 1, 0.01, 1e-4) == [2]
    assert choose([Candidate(gains, 0.05)], 1, 0.01, 1e-4) == [0]


def test_the_fit_finds_a_linear_cost_from_varied_samples():
    cost = LinearCost((1.0, 0.1, 0.1), ((1, 1, 0), (1, 2, 1), (1, 256, 16)))
    assert not cost.known
    true = np.array([0.004, 0.0003, 0.002])
    rng = np.random.default_rng(0)
    for _ in range(200):
        features = (1, int(rng.integers(1, 200)), int(rng.integers(0, 8)))
        cost.observe(features, float(true @ features))
    np.testing.assert_allclose(cost.weights, true, rtol=0.05)
    assert cost.seconds(1, 100, 4) == pytest.approx(float(true @ (1, 100, 4)), rel=0.02)


def test_the_fit_follows_a_change_of_cost():
    cost = LinearCost((1.0, 0.1), ((1, 1), (1, 16)))
    for sequences in [1, 2, 3, 4, 5, 6] * 20:
        cost.observe((1, sequences), 0.001 + 0.001 * sequences)
    for sequences in [1, 2, 3, 4, 5, 6] * 40:  # the machine got 3x slower
        cost.observe((1, sequences), 0.003 + 0.003 * sequences)
    assert cost.seconds(1, 4) == pytest.approx(0.015, rel=0.1)


def test_the_first_sample_scales_the_prior():
    cost = LinearCost((1.0, 0.5), ((1, 1), (1, 16)))
    cost.observe((1, 2), 0.02)
    assert cost.seconds(1, 2) == pytest.approx(0.02, rel=0.05)
    assert cost.weights[1] == pytest.approx(cost.weights[0] * 0.5, rel=0.2)


def test_acceptance_calibrates_the_drafters_probabilities():
    log_probs = np.log([0.9, 0.8, 0.6, 0.4])
    sure, unsure = Acceptance(4), Acceptance(4)
    for _ in range(40):
        sure.verified_round(log_probs, 3)  # more accepted than the drafter believes
        unsure.verified_round(log_probs, 0)
    assert sure.scale > 1.0 > 0.1 > unsure.scale
    assert sure.gains(log_probs).max() <= 1.0
    assert np.all(np.diff(sure.gains(log_probs)) <= 0)
    assert sure.gains(log_probs).sum() > 2.5 > 0.3 > unsure.gains(log_probs).sum()


def measured(budgets: Budgets, per_token: float) -> Budgets:
    """`budgets` fed passes of a known cost: 5 ms, a tree 2 ms, `per_token` a token; drafts
    3 ms + 2 ms a sequence."""
    for tokens, trees in [(1, 0), (16, 1), (40, 3), (6, 0), (96, 6), (20, 2)] * 10:
        budgets.observe_pass(tokens, trees, 0.005 + 0.002 * trees + per_token * tokens)
    for sequences in [1, 2, 4, 6] * 10:
        budgets.observe_draft(sequences, 0.003 + 0.002 * sequences)
    return budgets


def test_each_sequence_gets_the_nodes_its_own_acceptance_pays_for():
    budgets = measured(Budgets(), per_token=0.0003)
    log_probs = np.log(np.linspace(0.9, 0.1, 15))
    good, poor = Acceptance(15), Acceptance(15)
    for _ in range(30):
        good.verified_round(log_probs[:8], 6)
        poor.verified_round(log_probs[:8], 0)
    base = Baseline(tokens=2, trees=0, sequences=2)
    counts = budgets.nodes([(good, log_probs), (poor, log_probs)], base, draft_seconds=0.005)
    assert counts[0] > 0 and counts[1] == 0


def test_a_busier_batch_and_dearer_tokens_shrink_the_trees():
    log_probs = np.log(np.linspace(0.95, 0.2, 15))
    trees = [(Acceptance(15), log_probs) for _ in range(6)]
    cheap = measured(Budgets(), per_token=0.00005)
    dear = measured(Budgets(), per_token=0.002)
    base = Baseline(tokens=6, trees=0, sequences=6)
    cheap_counts = cheap.nodes(trees, base, 0.015)
    dear_counts = dear.nodes(trees, base, 0.015)
    assert sum(cheap_counts) > sum(dear_counts)
    assert max(cheap_counts) == 15


def test_the_draft_passs_fixed_cost_is_paid_once_by_the_step():
    """A draft pass costs 3 ms whoever drafts, plus 2 ms a sequence: among six, one sequence
    with a good tree does not draft (its tree does not pay for the time it costs the other
    five), six such share one pass and draft."""
    budgets = measured(Budgets(), per_token=0.0003)
    worth = np.log(np.r_[np.full(8, 0.9), np.full(7, 1e-9)])  # ~7.2 tokens in its first 8 nodes

    def batch(drafters: int) -> list[tuple[Acceptance, int]]:
        sequences = [Acceptance(15) for _ in range(6)]
        for index, acc in enumerate(sequences):
            acc.drafted(worth if index < drafters else np.full(15, -30.0))
        return [(acc, 15) for acc in sequences]

    six = Baseline(tokens=6, trees=0, sequences=6)
    assert budgets.drafting(batch(1), six) == [False] * 6
    assert budgets.drafting(batch(6), six) == [True] * 6


def test_a_sequence_whose_drafts_miss_stops_drafting_then_probes_again():
    budgets = measured(Budgets(), per_token=0.0003)
    missing = Acceptance(15)
    missing.drafted(np.log(np.full(15, 0.5)))
    for _ in range(30):
        missing.verified_round(np.log(np.full(15, 0.5)), 0)
    base = Baseline(tokens=1, trees=0, sequences=1)
    decisions = []
    for _ in range(PROBE_AFTER + 1):
        (drafts,) = budgets.drafting([(missing, 15)], base)
        decisions.append(drafts)
        missing.skipped = 0 if drafts else missing.skipped + 1
    assert decisions == [False] * PROBE_AFTER + [True]


def test_probes_that_pay_for_no_node_wait_longer_and_one_that_pays_resets_the_wait():
    """On a batch busy enough that no tree pays, a probe's draft is waste: each such probe
    doubles the rounds to the next one (to PROBE_MAX); a tree that gets nodes resets it."""
    budgets = measured(Budgets(), per_token=0.002)  # dear tokens: no tree pays at six
    seq = Acceptance(15)
    log_probs = np.log(np.full(15, 0.3))
    seq.drafted(log_probs)
    others = Baseline(tokens=6, trees=0, sequences=6)
    expected = [min(PROBE_AFTER << probe, PROBE_MAX) for probe in range(7)]
    assert expected[-2:] == [PROBE_MAX, PROBE_MAX]
    waits, skipped = [], 0
    for _ in range(sum(expected) + len(expected)):  # the skipped rounds and the probes
        (drafts,) = budgets.drafting([(seq, 15)], others)
        if not drafts:
            skipped = seq.skipped = seq.skipped + 1
            continue
        waits.append(skipped)
        (count,) = budgets.nodes([(seq, log_probs)], others, draft_seconds=0.015)
        assert count == 0
        seq.drafted(log_probs)  # a draft resets `skipped`
        skipped = 0
    assert waits == expected
    seq.paid(True)
    assert seq.probe_after == PROBE_AFTER


def test_probes_of_sequences_that_joined_at_different_times_share_one_draft_pass():
    """Six sequences on a batch where no tree pays, each joining a round after the last: a
    probe draws in those whose wait is half over, so after the first probes every step that
    drafts drafts for all six (one draft pass's fixed seconds, not six)."""
    budgets = measured(Budgets(), per_token=0.002)
    log_probs = np.log(np.full(15, 0.3))
    sequences, drafting_steps = [], []
    for step in range(6 + PROBE_AFTER + 16 + 32 + 64):
        if len(sequences) < 6:  # a new one has drafted its first round
            sequences.append(Acceptance(15))
            sequences[-1].drafted(log_probs)
        drafts = budgets.drafting([(acc, 15) for acc in sequences], Baseline(6, 0, 6))
        for acc, draws in zip(sequences, drafts, strict=True):
            acc.skipped += not draws
        fresh = [acc for acc, draws in zip(sequences, drafts, strict=True) if draws]
        if fresh:
            drafting_steps.append((step, len(fresh)))
            counts = budgets.nodes([(acc, log_probs) for acc in fresh], Baseline(6, 0, 6), 0.015)
            assert counts == [0] * len(fresh)
            for acc in fresh:
                acc.drafted(log_probs)
    assert [n for _, n in drafting_steps[-3:]] == [6, 6, 6]
    assert len(drafting_steps) <= 5  # without sharing: six sequences' probes, ~4 each
    gaps = np.diff([step for step, _ in drafting_steps[-3:]])
    assert gaps[1] > gaps[0]  # the waits still grow


def test_a_new_sequence_waits_for_its_first_probe_as_long_as_the_last_probes_taught():
    """Drafted steps of six that did not pay double the wait to the first probe of a sequence
    joining a batch of five to eight (to PROBE_MAX), as they do the probing sequences'; one
    joining alone keeps PROBE_AFTER (drafting may pay alone). A step of six that paid sets its
    wait back."""
    budgets = measured(Budgets(), per_token=0.002)  # dear tokens: no tree pays at six
    assert budgets.new_sequence(15, batch=6).probe_after == PROBE_AFTER
    weak = np.log(np.full(15, 0.3))
    for probes in range(1, 8):
        probing = [budgets.new_sequence(15, batch=6) for _ in range(6)]
        budgets.nodes([(acc, weak) for acc in probing], Baseline(6, 0, 6), 0.015)
        waited = budgets.new_sequence(15, batch=7).probe_after
        assert waited == min(PROBE_AFTER << probes, PROBE_MAX)
    assert budgets.new_sequence(15).probe_after == PROBE_AFTER
    cheap = measured(Budgets(), per_token=0.00001)
    cheap.probe_waits = dict(budgets.probe_waits)
    strong = np.log(np.full(15, 0.95))
    cheap.nodes([(cheap.new_sequence(15, 6), strong) for _ in range(6)], Baseline(6, 0, 6), 0.001)
    assert cheap.new_sequence(15, batch=6).probe_after == PROBE_AFTER


def test_alone_a_sequence_s_probes_teach_its_own_wait_and_not_the_next_sequence_s():
    """Alone, what a draft returns is the sequence's own text's acceptance: a chat whose drafts
    miss doubles its own wait to its next probe, each miss again, but the next chat, whose
    drafts may land, still probes after PROBE_AFTER rounds (a server-wide lone lesson stopped
    every later chat's probes: engine/NOTES.md, session 32)."""
    budgets = measured(Budgets(), per_token=0.0003)
    budgets.observe_solo(0.012)
    budgets.observe_alone(0.003)
    log_probs = np.log(np.linspace(0.9, 0.1, 15))
    for _ in range(4):  # chats whose drafts miss, one after another
        missing = budgets.new_sequence(15)
        waits = []
        for _ in range(5):
            missing.drafted(log_probs)
            budgets.verified(missing, log_probs, 0)
            budgets.solo_paid(missing, budgets.drafting_alone(missing))
            waits.append(missing.probe_after)
        assert waits == [min(PROBE_AFTER << n, PROBE_MAX) for n in range(1, 6)]
    landing = budgets.new_sequence(15)
    assert landing.probe_after == PROBE_AFTER
    landing.skipped = PROBE_AFTER
    assert budgets.drafting_alone(landing)


def test_a_sequence_takes_the_wait_of_the_batch_it_is_in_when_the_batch_changes_size():
    """One that joined alone (the lone wait: drafting may pay alone) and then decodes among six
    whose drafted steps stopped paying waits as long as the six's lesson says, not the lone
    wait it joined with; alone again, it takes the lone lesson back."""
    budgets = measured(Budgets(), per_token=0.002)  # dear tokens: no tree pays at six
    budgets.probe_waits[8] = PROBE_MAX  # what drafted steps of six taught
    first = budgets.new_sequence(15, batch=1)
    assert first.probe_after == PROBE_AFTER
    first.drafted(np.log(np.full(15, 0.3)))
    six = Baseline(tokens=6, trees=0, sequences=6)  # five beside it, decoding or prefilling
    for _ in range(2 * PROBE_AFTER):
        assert budgets.drafting([(first, 15)], six) == [False]
        first.skipped += 1
    assert first.probe_after == PROBE_MAX
    budgets.drafting_alone(first)
    assert first.probe_after == PROBE_AFTER and first.probe_due


def counting_choices(monkeypatch) -> list:
    """`choose`'s calls, each answering no node for anyone."""
    import engine.budgets as budgets_module

    calls = []
    monkeypatch.setattr(budgets_module, "choose", lambda *a: calls.append(a) or [0] * len(a[0]))
    return calls


def busy_step(budgets: Budgets, sequences: list[Acceptance], room: int, base: Baseline):
    """A plain step of a busy batch as the scheduler runs it: the pass observed, who drafts
    asked, each that does not skipping a round."""
    budgets.observe_pass(base.tokens, 0, 0.02)
    drafts = budgets.drafting([(acc, room) for acc in sequences], base)
    for acc, draws in zip(sequences, drafts, strict=True):
        acc.skipped += not draws
    return drafts


def test_a_steps_answer_that_none_drafts_is_kept_until_something_it_read_changes(monkeypatch):
    """Steps of a busy batch where nothing the choice reads changed reuse it; a sequence's
    fresh tree, another batch, the cost fit CHOICE_PASSES samples on, a probe falling due,
    or a node room coming within the cap make it anew."""
    budgets = measured(Budgets(), per_token=0.002)
    calls = counting_choices(monkeypatch)
    budgets.probe_waits[8] = PROBE_MAX  # drafted steps of six taught: no probe soon
    sequences = [Acceptance(15) for _ in range(6)]
    for acc in sequences:
        acc.drafted(np.log(np.full(15, 0.3)))
    six = Baseline(6, 0, 6)
    for _ in range(3):
        busy_step(budgets, sequences, 1000, six)
    assert len(calls) <= 2  # the fit may cross into its next CHOICE_PASSES samples once
    calls.clear()
    sequences[2].drafted(np.log(np.full(15, 0.6)))
    busy_step(budgets, sequences, 1000, six)
    assert len(calls) == 1
    for _ in range(CHOICE_PASSES):
        busy_step(budgets, sequences, 1000, six)
    assert len(calls) == 2
    busy_step(budgets, sequences, 1000, Baseline(5, 0, 5))
    assert len(calls) == 3
    sequences[0].skipped = PROBE_MAX - 1  # due in the second step from here
    assert busy_step(budgets, sequences, 1000, Baseline(5, 0, 5)) == [False] * 6
    assert len(calls) == 3
    assert busy_step(budgets, sequences, 1000, Baseline(5, 0, 5))[0]  # its probe
    assert len(calls) == 4
    sequences[0].drafted(np.log(np.full(15, 0.3)))
    busy_step(budgets, sequences, 1000, six)
    assert len(calls) == 5
    for acc in sequences:
        acc.skipped = 0
    for room in (17, 16, 15):  # the room reads as the cap while at or past it
        busy_step(budgets, sequences, room, six)
    assert len(calls) == 5
    busy_step(budgets, sequences, 14, six)
    assert len(calls) == 6


def test_a_kept_answer_is_the_one_the_step_would_choose(monkeypatch):
    """Two choosers with the same cost fits fed the same busy batch, one keeping its answers
    that none drafts and one choosing every step: their answers agree step by step, as the
    drafts turn good (trees pay) and poor (none does, probes now and then), another
    sequence's tree comes and goes beside them, sequences leave and join, and rooms come
    within the cap. (The fits stay as measured: a kept answer is the choice as of the fits'
    last CHOICE_PASSES samples, as a choice made anew is.)"""
    rng = np.random.default_rng(7)
    kept, fresh = measured(Budgets(), 0.0003), measured(Budgets(), 0.0003)
    monkeypatch.setattr(fresh, "_still_quiet", lambda *a: False)
    made = {}  # each chooser's choices made anew
    for budgets in (kept, fresh):
        paying = budgets._paying
        made[id(budgets)] = calls = []
        monkeypatch.setattr(budgets, "_paying", lambda *a, p=paying, c=calls: c.append(1) or p(*a))
    log_probs = np.log(np.linspace(0.9, 0.3, 15))
    batches: dict[int, list[Acceptance]] = {id(kept): [], id(fresh): []}
    answers = []
    for step in range(800):
        if step % 150 == 0:  # a sequence leaves, new ones join
            for key, batch in batches.items():
                batch = batch[1:] if len(batch) == 6 else batch
                batches[key] = [*batch, *[Acceptance(15) for _ in range(6 - len(batch))]]
        good = step // 200 % 2 == 1
        base = Baseline(22, 1, 7) if step // 50 % 3 == 2 else Baseline(6, 0, 6)
        accepted = int(rng.integers(8, 12)) if good else int(rng.integers(0, 2))
        step_answers = []
        for budgets in (kept, fresh):
            sequences = batches[id(budgets)]
            drafts = budgets.drafting([(acc, 810 - step) for acc in sequences], base)
            drafted = [acc for acc, draws in zip(sequences, drafts, strict=True) if draws]
            for acc, draws in zip(sequences, drafts, strict=True):
                acc.skipped += not draws
            for acc in drafted:
                budgets.drafted(acc, log_probs)
            if drafted:
                counts = budgets.nodes([(acc, log_probs) for acc in drafted], base, 0.01)
                for acc, count in zip(drafted, counts, strict=True):
                    if count:
                        budgets.verified(acc, log_probs[:count], min(count, accepted))
            step_answers.append(drafts)
        answers.append(step_answers)
    assert all(a == b for a, b in answers)
    drafted_steps = sum(any(a) for a, _ in answers)
    assert drafted_steps > 100 and len(answers) - drafted_steps > 100
    assert len(made[id(kept)]) < len(made[id(fresh)]) / 2


def test_a_lone_sequence_drafts_when_its_measured_round_beats_its_bonus_alone():
    """Alone, the choice is a drafted round by generate()'s static passes (measured whole)
    against a one-token pass: a sequence whose drafts land drafts, one whose drafts miss
    decodes its bonus alone and probes again after PROBE_AFTER rounds."""
    budgets = measured(Budgets(), per_token=0.0003)  # a one-token pass: 5.3 ms
    log_probs = np.log(np.linspace(0.9, 0.1, 15))
    landing, missing = Acceptance(15), Acceptance(15)
    assert budgets.drafting_alone(missing)  # no solo round measured yet: it drafts
    budgets.observe_solo(0.012)
    budgets.observe_solo(0.012)
    for acceptance, accepted in ((landing, 6), (missing, 0)):
        acceptance.drafted(log_probs)
        for _ in range(30):
            acceptance.verified_round(log_probs, accepted)
    assert budgets.solo_round == pytest.approx(0.012)
    assert budgets.drafting_alone(landing)
    assert not budgets.drafting_alone(missing)
    missing.skipped = PROBE_AFTER
    assert budgets.drafting_alone(missing)
    budgets.observe_alone(0.001)  # measured: 1,000 tokens/s beat its ~500 (the fit said 5.3 ms)
    assert not budgets.drafting_alone(landing)
    budgets.bonus_round = None
    budgets.observe_solo(1.0)  # rounds grown dear: the mean follows
    assert budgets.solo_round > 0.1 and not budgets.drafting_alone(landing)


def test_a_new_sequence_starts_from_the_servers_mean_acceptance():
    """A generation's first rounds say little about its acceptance: a new sequence's mean
    starts at the server's so far (every auto sequence's drafted rounds), then follows its own."""
    budgets = Budgets()
    assert budgets.new_sequence(15).mean_accepted == 1.0  # nothing measured: the prior's 1
    earlier = budgets.new_sequence(15)
    for _ in range(50):
        budgets.verified(earlier, np.log(np.full(15, 0.5)), 3)
    fresh = budgets.new_sequence(15)
    assert fresh.mean_accepted == pytest.approx(3.0)
    for _ in range(40):
        budgets.verified(fresh, np.log(np.full(15, 0.5)), 0)
    assert fresh.mean_accepted < 0.6 < budgets.new_sequence(15).mean_accepted < 3.0  # both


def test_a_new_sequence_on_a_busy_batch_waits_for_its_probe_once_the_server_has_trees():
    """The server's first sequence drafts its first round (nothing to judge it by); one that
    joins after trees were drafted starts from their profile and, on a batch where no tree
    pays, decodes its bonus alone until its first probe."""
    budgets = measured(Budgets(), per_token=0.002)  # dear tokens: no tree pays at six
    busy = Baseline(tokens=6, trees=0, sequences=6)
    first = budgets.new_sequence(15)
    assert first.profile is None and budgets.drafting([(first, 15)], busy) == [True]
    weak = np.log(np.r_[np.full(4, 0.3), np.full(6, 0.01)])  # a tree of 10 nodes
    for _ in range(20):
        budgets.drafted(first, weak)
    joining = budgets.new_sequence(15)
    assert joining.profile == pytest.approx(np.r_[np.exp(weak), np.zeros(5)])
    assert budgets.drafting([(joining, 15)], busy) == [False]
    joining.skipped = PROBE_AFTER
    assert budgets.drafting([(joining, 15)], busy) == [True]


def test_before_any_measurement_every_sequence_drafts_its_cap():
    budgets = Budgets()
    acceptance = Acceptance(15)
    assert budgets.drafting([(acceptance, 15)], Baseline(1, 0, 1)) == [True]
    assert budgets.nodes([(acceptance, np.zeros(15))], Baseline(1, 0, 1), 0.0) == [15]
