"""Chunked prefill (`extend`, engine/decode.py's `prefill_chunk`) on the dense and hybrid targets.

    python -m pytest -q tests/engine/test_prefill.py

A prompt run in chunks, each committed as it goes (K/V in place, the GDN conv window and state
carried from chunk to chunk), leaves the same state as one pass: the last token's logits and
the next steps' logits agree within 1e-10 in float64, the tokens are identical in float32, the
logits still match transformers', and speculative decoding still equals greedy.
"""

from __future__ import annotations

import pytest
import torch

from engine.decode import GenerationConfig, generate
from engine.models import load_drafter, load_target
from tests.helpers.tiny_hybrid import (
    build_tiny_hybrid,
    save_tiny_hybrid,
    save_tiny_hybrid_drafter,
)
from tests.helpers.tiny_qwen3 import save_tiny_dflash, save_tiny_qwen3

PROMPT = torch.randint(3, 90, (37,), generator=torch.Generator().manual_seed(0)).tolist()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def pair(request, tmp_path_factory):
    """(target dir, drafter dir) of a tiny dense or hybrid target."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "dense":
        target = save_tiny_qwen3(root / "target", seed=0, tokenizer=False)
        return target, save_tiny_dflash(root / "draft", target, seed=1)
    target = save_tiny_hybrid(root / "target", seed=0, tokenizer=False)
    return target, save_tiny_hybrid_drafter(root / "draft", target, seed=1)


def prefill_then_steps(model, prompt: list[int], chunk: int, steps: list[int]):
    """Last-token logits of a chunked prefill, then the logits of each following AR step."""
    cache = model.new_cache(len(prompt) + len(steps))
    ids = torch.tensor(prompt)
    for start in range(0, len(prompt), chunk):
        logits, _ = model.extend(ids[start : start + chunk], cache)
    rows = [logits[0]]
    for token in steps:
        step, _ = model.forward(torch.tensor([token]), cache)
        model.commit(cache, torch.tensor([0]))
        rows.append(step[0])
    assert cache.length == len(prompt) + len(steps)
    return torch.stack(rows)


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_equals_one_pass_in_float64(pair, chunk):
    model = load_target(pair[0], torch.float64)
    steps = [4, 50, 7]
    whole = prefill_then_steps(model, PROMPT, len(PROMPT), steps)
    chunked = prefill_then_steps(model, PROMPT, chunk, steps)
    assert whole.dtype == torch.float64
    assert (whole - chunked).abs().max().item() <= 1e-10


def test_extend_logits_match_transformers_across_chunks(tmp_path):
    path = save_tiny_hybrid(tmp_path / "h", seed=3, tokenizer=False)
    reference = build_tiny_hybrid(seed=3)
    model = load_target(path)
    ours = prefill_then_steps(model, PROMPT, 8, [11, 5])
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT + [11, 5]])).logits[0, len(PROMPT) - 1 :]
    assert ours.shape == (3, 128)
    assert (ours - expected).abs().max().item() <= 2e-4


@pytest.mark.parametrize("method", ["ar", "linear", "ddtree"])
def test_chunked_prefill_decodes_the_same_tokens_in_float32(pair, method):
    target = load_target(pair[0])
    drafter = load_drafter(pair[1]) if method != "ar" else None
    outputs = {}
    for chunk in (len(PROMPT), 6):
        cfg = GenerationConfig(method=method, budget=6, max_new_tokens=12, prefill_chunk=chunk)
        outputs[chunk] = generate(target, drafter, PROMPT, cfg).output_ids
    greedy = generate(target, None, PROMPT, GenerationConfig(method="ar", max_new_tokens=12))
    assert outputs[len(PROMPT)] == outputs[6] == greedy.output_ids


def test_a_bad_chunk_size_is_refused(pair):
    target = load_target(pair[0])
    with pytest.raises(ValueError, match="prefill_chunk"):
        generate(target, None, PROMPT, GenerationConfig(method="ar", prefill_chunk=0))
