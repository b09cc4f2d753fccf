"""Decode rounds on a GPU at Qwen3.6-27B's layer widths, each figure printed beside its target.

With random bf16 weights at the real widths and vocabulary (engine/tools/gpu_memory.py's config)
and a few layers, after a `prefix`-token prefill, through the engine's own `generate`:
- the ar step (ms per token, the median round once the graphs are captured) against the
  bandwidth floor (the bytes a step must read: weights, KV of the prefix, GDN state, at the
  bandwidth a device copy reaches), both scaled per layer to Qwen3.6-27B's 64 layers from runs
  at `layers` and 2 x `layers` (target <= 1.2x);
- verify(budget + 1) / ar step (the verify stage of a DDTree round over the ar one, each
  round's own from a traced generation; target <= 1.15);
- host syncs per round (`torch.cuda.set_sync_debug_mode("warn")`, the worst round after the
  first two, which capture the graphs; target <= 3);
- CUDA graph replay against eager (`cuda_graphs=False`), ms per ar step and per verify, and
  what the first rounds of a generation, which capture its graphs, cost either way;
- recompiles while the context grows: Triton kernels compiled by generations at longer prefixes
  after a first one (target 0);
- a conversation in a server's pool (engine/cache_pool.py): turns that each add TURN_TOKENS to
  the last one's prompt and answer, their graphs captured in the first turn only (target 0
  captures after it), and the time to first token of a turn from the prefix cache over that of
  the same turn cold (`cache_prompt` off).

    python -m engine.tools.gpu_rounds [--layers 4] [--prefix 32768] [--budget 15] [--json]

Exit status: 0 all targets met, 1 one missed, 2 no CUDA device ("needs CUDA": nothing measured).
`check_rounds(device, ...)` returns the figures as dicts for engine/tools/gpu_check.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

import torch

from engine.decode import GenerationConfig, generate
from engine.models.common import materialize
from engine.models.dflash import DFlashConfig, DFlashDrafter
from engine.models.qwen3_5 import Qwen3_5Config, Qwen3_5Model
from engine.tools.arguments import positive_int
from engine.tools.gpu_memory import stack_config

FULL_LAYERS = 64  # Qwen3.6-27B
KV_BYTES_PER_TOKEN_PER_ATTENTION_LAYER = 2 * 4 * 256 * 2  # K and V, 4 heads x 256, bf16
GROWTH = (256, 512)  # tokens added to the prefix by the later generations (recompile check)
TURN_TOKENS = 64  # what each turn of the pooled conversation adds after the last answer
DRAFT_LAYERS = 1
NEW_TOKENS = 48
WARM_ROUNDS = 2  # the first rounds of a generation capture its graphs: left out
DRAFT_HEADS = (32, 8, 128)  # the drafter's attention heads, KV heads, head dim (z-lab's 27B)
# a tiny pair for CPU tests of the tools (the same layer pattern, every width small)
TINY_VOCAB, TINY_DRAFT_HEADS = 512, (4, 2, 16)
TINY_WIDTHS = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16,
)  # fmt: skip


@dataclass
class Figure:
    """One measured figure and its target (`limit`, None for a figure without one)."""

    name: str
    value: float
    limit: float | None
    unit: str = ""

    @property
    def passed(self) -> bool:
        return self.limit is None or self.value <= self.limit

    def line(self) -> str:
        target = "" if self.limit is None else f"  (target <= {self.limit:g}{self.unit})"
        verdict = "" if self.limit is None else ("  ok" if self.passed else "  MISSED")
        return f"  {self.name:34s} {self.value:10.3f}{self.unit}{target}{verdict}"


def floor_ms(bytes_read: int, bandwidth: float) -> float:
    """The least time a step reading `bytes_read` can take at `bandwidth` bytes/s, in ms."""
    return 1000.0 * bytes_read / bandwidth


def per_layer_fit(
    ms_small: float, layers_small: int, ms_large: float, layers_large: int, layers: int
) -> float:
    """ms at `layers` from the straight line through two measured (layers, ms) points."""
    slope = (ms_large - ms_small) / (layers_large - layers_small)
    return ms_small + slope * (layers - layers_small)


def step_bytes(model: Qwen3_5Model, prefix: int) -> int:
    """What one ar step must read: every weight but the embedding table (one row of it), the
    prefix's K/V in the attention layers, every GDN layer's state."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.embed_tokens.weight
    weights -= embedding.numel() * embedding.element_size()
    c = model.config
    attention = sum(t == "full_attention" for t in c.layer_types)
    kv = attention * prefix * 2 * c.num_key_value_heads * c.head_dim * embedding.element_size()
    gdn = len(c.layer_types) - attention
    state = gdn * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    return weights + kv + state


def copy_bandwidth(device: torch.device, size: int = 1 << 30) -> float:
    """Bytes/s a device-to-device copy reaches (read + write counted)."""
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    repeats = 10
    for _ in range(repeats):
        target.copy_(source)
    torch.cuda.synchronize(device)
    return 2 * size * repeats / (time.perf_counter() - started)


def random_pair(device: torch.device, dtype: torch.dtype, layers: int, tiny: bool = False):
    """A target of `layers` layers at Qwen3.6-27B's widths (`tiny`: TINY_WIDTHS) and a DFlash
    drafter of DRAFT_LAYERS layers reading up to five of them, random weights."""
    widths, draft_heads = (TINY_WIDTHS, TINY_DRAFT_HEADS) if tiny else ({}, DRAFT_HEADS)
    vocab = TINY_VOCAB if tiny else 248320
    config = Qwen3_5Config.from_hf(stack_config(layers, vocab, **widths))
    heads, kv_heads, head_dim = draft_heads
    draft_config = DFlashConfig(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=DRAFT_LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        block_size=16,
        mask_token_id=config.vocab_size - 1,
        target_layer_ids=tuple(range(min(5, layers))),
    )
    with torch.device("meta"):
        target, drafter = Qwen3_5Model(config), DFlashDrafter(draft_config)
    models = [materialize(m, dtype, device).eval() for m in (target, drafter)]
    with torch.no_grad():
        for model in models:
            for parameter in model.parameters():
                parameter.normal_(0.0, 0.02)
    return models


@contextmanager
def counted_syncs() -> Iterator[list]:
    """The warnings torch's sync debug mode raises inside the block (one per host sync)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


@contextmanager
def counted_compiles() -> Iterator[list]:
    """The Triton kernels compiled inside the block."""
    import triton

    compiled: list = []
    before = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **kwargs: compiled.append(kwargs["key"])
    try:
        yield compiled
    finally:
        triton.knobs.runtime.jit_post_compile_hook = before


def decode(target, drafter, prefix: int, method: str, budget: int, graphs: bool, **options):
    """(the GenerationResult, host syncs and wall ms of each round) of one generation after a
    random prefix; `options`: trace, seed."""
    seed = options.pop("seed", 0)
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, target.config.vocab_size - 1, (prefix,), generator=generator)
    cfg = GenerationConfig(
        method=method, budget=budget, max_new_tokens=NEW_TOKENS, cuda_graphs=graphs, **options
    )
    marks: list[tuple[int, float]] = []
    with torch.inference_mode(), counted_syncs() as syncs:
        result = generate(
            target,
            drafter if method != "ar" else None,
            prompt.tolist(),
            cfg,
            on_tokens=lambda _: marks.append((len(syncs), time.perf_counter())),
        )
    pairs = list(itertools.pairwise(marks))
    return result, [b[0] - a[0] for a, b in pairs], [1000 * (b[1] - a[1]) for a, b in pairs]


def steady(values: list[float]) -> float:
    """The median of a generation's per-round values once its graphs are captured."""
    return statistics.median(values[WARM_ROUNDS:])


def verify_ms(result) -> list[float]:
    return [1000 * seconds["verify"] for seconds in result.round_seconds]


def measure(target, drafter, prefix: int, budget: int) -> dict:
    """ms per ar step (wall, per round) and per verify stage (ar and DDTree), with graphs and
    eagerly (traced: each round's own stage seconds); host syncs per round (untraced)."""
    figures = {}
    for graphs in (True, False):
        mode = "graphs" if graphs else "eager"
        ar, _, ar_ms = decode(target, drafter, prefix, "ar", budget, graphs, trace=True)
        tree, _, tree_ms = decode(target, drafter, prefix, "ddtree", budget, graphs, trace=True)
        figures[f"first_rounds_ms_{mode}"] = sum(tree_ms[:WARM_ROUNDS])
        figures[f"step_ms_{mode}"] = steady(ar_ms)
        figures[f"ar_verify_ms_{mode}"] = steady(verify_ms(ar))
        figures[f"tree_verify_ms_{mode}"] = steady(verify_ms(tree))
    syncs = [decode(target, drafter, prefix, m, budget, True)[1] for m in ("ar", "ddtree")]
    figures["syncs_per_round"] = max(max(per_round[WARM_ROUNDS:]) for per_round in syncs)
    return figures


def check_rounds(
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    layers: int = 4,
    prefix: int = 32768,
    budget: int = 15,
) -> list[dict]:
    """Every figure (see the module docstring) as a dict with name, value, limit, unit, passed."""
    bandwidth = copy_bandwidth(device)
    runs = {}
    for count in (layers, 2 * layers):
        target, drafter = random_pair(device, dtype, count)
        runs[count] = measure(target, drafter, prefix, budget) | {
            "floor_ms": floor_ms(step_bytes(target, prefix), bandwidth)
        }
        if count == layers:
            compiles = recompiles(target, drafter, prefix, budget)
            pooled = pooled_conversation(target, drafter, prefix, budget)
        del target, drafter
        torch.cuda.empty_cache()
    small, large = runs[layers], runs[2 * layers]

    def at_64(key: str) -> float:
        return per_layer_fit(small[key], layers, large[key], 2 * layers, FULL_LAYERS)

    step, floor = at_64("step_ms_graphs"), at_64("floor_ms")
    figures = [
        Figure("ar step ms (64 layers)", step, None, " ms"),
        Figure("bandwidth floor ms (64 layers)", floor, None, " ms"),
        Figure("ar step / floor", step / floor, 1.2, "x"),
        Figure(
            f"verify({budget + 1}) / ar verify",
            at_64("tree_verify_ms_graphs") / at_64("ar_verify_ms_graphs"),
            1.15,
            "x",
        ),
        Figure("host syncs per round", max(small["syncs_per_round"], large["syncs_per_round"]), 3),
        Figure("ar step ms eager (64 layers)", at_64("step_ms_eager"), None, " ms"),
        Figure("eager / graph ar step", at_64("step_ms_eager") / step, None, "x"),
        Figure(
            f"eager / graph verify({budget + 1})",
            at_64("tree_verify_ms_eager") / at_64("tree_verify_ms_graphs"),
            None,
            "x",
        ),
        Figure("ddtree first rounds ms, graphs", at_64("first_rounds_ms_graphs"), None, " ms"),
        Figure("ddtree first rounds ms, eager", at_64("first_rounds_ms_eager"), None, " ms"),
        Figure("recompiles as the context grows", compiles, 0),
        Figure("pooled: graph captures after turn 1", pooled["captures_after_first_turn"], 0),
        Figure(
            f"pooled: TTFT cached / cold ({layers} layers)",
            pooled["ttft_cached_ms"] / pooled["ttft_cold_ms"],
            0.25,
            "x",
        ),
    ]
    return [asdict(f) | {"passed": f.passed} for f in figures]


@contextmanager
def counted_captures() -> Iterator[list]:
    """The static passes captured as CUDA graphs inside the block (engine/decode.py)."""
    from engine import decode as decoding

    captured: list = []
    capture = decoding.StaticPass._capture

    def counting(self):
        captured.append(self)
        return capture(self)

    decoding.StaticPass._capture = counting
    try:
        yield captured
    finally:
        decoding.StaticPass._capture = capture


def pooled_conversation(
    target, drafter, prefix: int, budget: int, turns: int = 3, cache_bytes: int = 8 << 30
) -> dict:
    """A ddtree conversation of `turns` turns in one pool with a prefix cache: graphs captured
    after the first turn, and the last turn's TTFT from the cache and cold (ms)."""
    from engine.cache_pool import CachePool

    pool = CachePool.for_server(target, drafter, prefix + turns * 2 * NEW_TOKENS, cache_bytes)
    cfg = GenerationConfig(method="ddtree", budget=budget, max_new_tokens=NEW_TOKENS)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, target.config.vocab_size - 1, (prefix,), generator=generator).tolist()
    captures = []
    with torch.inference_mode(), counted_captures() as captured:
        for turn in range(turns):
            cold = generate(target, drafter, prompt, replace(cfg, cache_prompt=False), pool=pool)
            warm = generate(target, drafter, prompt, cfg, pool=pool)
            captures.append(len(captured))
            prompt = prompt + warm.output_ids + prompt[turn : turn + TURN_TOKENS]
    return {
        "captures_after_first_turn": captures[-1] - captures[0],
        "ttft_cold_ms": 1000 * cold.ttft_s,
        "ttft_cached_ms": 1000 * warm.ttft_s,
        "cached_tokens": warm.cached_tokens,
    }


def recompiles(target, drafter, prefix: int, budget: int) -> int:
    """Triton kernels compiled by generations at longer prefixes, after one at `prefix`."""
    decode(target, drafter, prefix, "ddtree", budget, graphs=True)
    with counted_compiles() as compiled:
        for extra in GROWTH:
            decode(target, drafter, prefix + extra, "ddtree", budget, graphs=True, seed=extra)
    return len(compiled)


def print_rounds(figures: list[dict], layers: int, prefix: int) -> None:
    print(
        f"rounds ({layers} and {2 * layers} layers at Qwen3.6-27B widths, {prefix}-token prefix):"
    )
    for figure in figures:
        figure = {k: v for k, v in figure.items() if k != "passed"}
        print(Figure(**figure).line())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=positive_int, default=4, help="the smaller stack's layers")
    parser.add_argument("--prefix", type=positive_int, default=32768, help="prompt tokens")
    parser.add_argument("--budget", type=positive_int, default=15, help="ddtree node budget")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_rounds: needs CUDA (no CUDA device here): nothing measured", file=sys.stderr)
        return 2
    figures = check_rounds(
        torch.device("cuda"), torch.bfloat16, args.layers, args.prefix, args.budget
    )
    if args.json:
        print(json.dumps(figures))
    else:
        print_rounds(figures, args.layers, args.prefix)
    return 0 if all(f["passed"] for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
