"""A decode round waits for the device at most three times, and uses the static passes.

On a GPU a host sync is a read of device data (`.tolist()`, `.item()`, `.cpu()`, `int(t)`, ...)
or a blocking host-to-device copy. On the CPU the same calls are counted by a TorchFunctionMode
that tracks which tensors would live on the device: those that torch ops produce, as opposed to
host data (`torch.tensor` without a device, `torch.from_numpy`, `.cpu()` results). A round is
the span between two calls of generate's `on_tokens`.

Run: python -m pytest -q tests/engine/test_round_syncs.py
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine.cache_pool import CachePool
from engine.decode import GenerationConfig, generate
from engine.grammar import Constraint
from engine.sampling import Sampling
from engine.scheduler import Request, Scheduler
from tests.helpers.tiny_grammar import STOP, char_tokenizer
from tests.helpers.tiny_pairs import KINDS, load_tiny_pair

Tensor = torch.Tensor
READS = {
    Tensor.tolist,
    Tensor.item,
    Tensor.cpu,  # (`.numpy()` only works on host tensors: never a sync by itself)
    Tensor.__int__,
    Tensor.__float__,
    Tensor.__bool__,
    Tensor.__index__,
    Tensor.nonzero,
}
HOST_RESULTS = {Tensor.cpu, Tensor.numpy, Tensor.tolist, Tensor.pin_memory}
COPIES = {Tensor.to, Tensor.copy_, Tensor.cuda}
MARK = "_made_on_device"  # set on every tensor a torch op returns (a device tensor on a GPU)


def on_device(value) -> bool:
    return isinstance(value, torch.nn.Parameter) or (
        isinstance(value, Tensor) and getattr(value, MARK, False)
    )


class HostSyncs(TorchFunctionMode):
    """Counts the calls that would make the host wait if device-made tensors were on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.count += self._syncs(func, args, kwargs)
        if func not in HOST_RESULTS and not (func is torch.tensor and "device" not in kwargs):
            for tensor in out if isinstance(out, tuple | list) else (out,):
                if isinstance(tensor, Tensor):
                    setattr(tensor, MARK, True)
        return out

    def _syncs(self, func, args, kwargs) -> int:
        first = args[0] if args else None
        if func in READS:
            return int(on_device(first))
        if func is torch.tensor:
            return int(kwargs.get("device") is not None)  # built on the host, copied, waited for
        if func in COPIES and not kwargs.get("non_blocking", False):
            source = args[1] if func is Tensor.copy_ else first
            return int(isinstance(source, Tensor) and not on_device(source))
        return 0


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp(request.param), request.param)


def syncs_per_round(target, drafter, cfg: GenerationConfig) -> list[int]:
    marks: list[int] = []
    counter = HostSyncs()
    with counter:
        result = generate(
            target,
            drafter,
            [5, 9, 17, 4, 30, 8],
            cfg,
            on_tokens=lambda _: marks.append(counter.count),
        )
    assert len(marks) == len(result.acceptance_lengths) + 1  # the prefill's bonus, then rounds
    return [after - before for before, after in itertools.pairwise(marks)]


@pytest.mark.parametrize(("method", "budget"), [("ar", 0), ("linear", 0), ("ddtree", 6)])
def test_a_round_syncs_at_most_three_times(pair, method, budget):
    target, drafter = pair
    cfg = GenerationConfig(method=method, budget=budget, max_new_tokens=24)
    per_round = syncs_per_round(target, None if method == "ar" else drafter, cfg)
    assert len(per_round) >= 3
    assert max(per_round) <= 3, per_round
    assert min(per_round) >= 1  # the choices are read back: the counter sees reads


@pytest.mark.parametrize(("method", "budget"), [("ar", 0), ("linear", 0), ("ddtree", 6)])
def test_a_grammar_and_penalties_add_no_sync(pair, method, budget):
    """Masks and penalties reach the device in non-blocking copies of host data: a constrained,
    penalised, warped round waits no more often than a plain one."""
    target, drafter = pair
    vocab = target.lm_head.weight.shape[0]
    plain = GenerationConfig(method, budget, max_new_tokens=24, temperature=0.7, seed=1)
    constrained = GenerationConfig(
        method,
        budget,
        max_new_tokens=24,
        temperature=0.7,
        seed=1,
        stop_token_ids=(STOP,),
        constraint=Constraint.from_lark(char_tokenizer(vocab), "start: /[a-z]{30,60}/"),
        sampling=Sampling(top_p=0.9, top_k=5, presence_penalty=1.0, repetition_penalty=1.2),
    )
    drafter = None if method == "ar" else drafter
    per_round = syncs_per_round(target, drafter, constrained)
    assert len(per_round) >= 3
    assert max(per_round) <= max(syncs_per_round(target, drafter, plain)), per_round


@pytest.mark.parametrize(("method", "budget"), [("ar", 0), ("linear", 0), ("ddtree", 6)])
def test_logprobs_add_no_sync(pair, method, budget):
    """A round's logprobs are read back with its choices, in the same one read."""
    target, drafter = pair
    drafter = None if method == "ar" else drafter
    cfg = GenerationConfig(method, budget, max_new_tokens=24, temperature=0.7, seed=1)
    scored = GenerationConfig(method, budget, max_new_tokens=24, temperature=0.7, seed=1)
    scored.logprobs = 20
    assert syncs_per_round(target, drafter, scored) == syncs_per_round(target, drafter, cfg)


def test_rounds_run_the_static_passes(pair, monkeypatch):
    """After the prefill no round uses the dynamic-shape forward, and the drafter's growing
    path runs only once, for the prompt's context (longer than a round commits)."""
    target, drafter = pair
    drafts = []
    draft = drafter.draft
    monkeypatch.setattr(drafter, "draft", lambda *a: drafts.append(1) or draft(*a))

    def refuse(*args, **kwargs):
        raise AssertionError("a round ran the dynamic-shape forward")

    monkeypatch.setattr(target, "forward", refuse)
    for method in ("ar", "linear", "ddtree"):
        drafts.clear()
        cfg = GenerationConfig(method=method, budget=6, max_new_tokens=20)
        prompt = list(range(5, 17))
        result = generate(target, None if method == "ar" else drafter, prompt, cfg)
        assert len(result.output_ids) == 20
        assert drafts == ([] if method == "ar" else [1])


def test_a_traced_round_carries_its_own_stage_seconds(pair):
    target, drafter = pair
    cfg = GenerationConfig(method="ddtree", budget=6, max_new_tokens=24, trace=True)
    result = generate(target, drafter, [5, 9, 17, 4, 30, 8], cfg)
    rounds = result.round_seconds
    assert len(rounds) == len(result.rounds) == len(result.acceptance_lengths)
    assert all(r["prefill"] == 0 and r["verify"] > 0 for r in rounds)
    for stage in ("draft", "tree", "verify", "commit"):
        assert sum(r[stage] for r in rounds) == pytest.approx(result.stage_seconds[stage])


def test_a_batched_step_waits_neither_a_sequence_nor_a_layer(pair):
    """A scheduler step of six sequences (ar, ddtree at two budgets, a DFlash chain; one pass
    over them all) reads every sequence's choices in one read, each budget's drafts in one and
    the chain's: nothing a sequence, nothing in its layers. Each GDN layer's gathered states,
    commits and conv windows, the trees' layout and the pass's rows reach the device in
    non-blocking copies (a hybrid step of six waited 48 times when they were
    `torch.tensor(..., device=...)` and `.to(device)` copies and each choice was read alone)."""
    target, drafter = pair
    pool = CachePool(target, drafter, 96, None)
    sched = Scheduler(target, drafter, pool.slots(6), max_num_batched_tokens=64)
    methods = [("ar", 0), ("ddtree", 6), ("linear", 0), ("ddtree", 3), ("ddtree", 6), ("ar", 0)]
    for index, (method, budget) in enumerate(methods):
        cfg = GenerationConfig(method, budget, max_new_tokens=24)
        sched.add(Request([5 + index, 9, 17, 4, 30, 8][: 3 + index], cfg))
    while sched.waiting or any(active.prefilling for active in sched.running):
        sched.step()
    sched.step()  # the drafters' first blocks: a table copied from pinned memory on CUDA
    for _ in range(3):
        counter = HostSyncs()
        with counter:
            sched.step()
        assert len(sched.running) == 6
        assert counter.count <= 4, counter.count  # the choices; two budgets' drafts; a chain
