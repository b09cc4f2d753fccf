"""Requests through a scheduler beside their solo runs: what the batching tests share
(tests/engine/test_batching.py, tests/engine/test_step_passes.py). Tiny pairs' prompts, a
config of every method (greedy and sampled), a collector of each request's streamed tokens and
result, a scheduler over a server's slots (or an oversubscribed pool of small blocks), and a
request's solo `generate`."""

from __future__ import annotations

import torch

from engine.cache_pool import CachePool
from engine.decode import GenerationConfig, generate
from engine.memory_plan import BLOCK_TOKENS
from engine.prefix_cache import PrefixCache, has_states
from engine.scheduler import Finished, Request, Scheduler

NEW = 16
SLOT = 160  # tokens of each slot's caches
PAGE = 4  # tokens of a KV block in the preemption tests' small pools
SCHEMA = {  # bounded, so a random model's JSON ends
    "type": "object",
    "properties": {"id": {"enum": [1, 22, 333]}, "tag": {"type": "string", "maxLength": 4}},
    "required": ["id", "tag"],
    "additionalProperties": False,
}
POOL = 128  # tokens of the small pools: the longest request fits alone, six at once do not


def prompts(pair, lengths: list[int], seed: int = 0) -> list[list[int]]:
    vocab = pair[0].config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


MIXED = [  # (method, budget, temperature): every method, greedy and sampled
    ("ar", 1, 0.0),
    ("ddtree", 6, 0.0),
    ("linear", 1, 0.0),
    ("ddtree", 15, 1.0),
    ("ar", 1, 0.8),
    ("ddtree", 3, 0.0),
]


def configs(**changes) -> list[GenerationConfig]:
    return [
        GenerationConfig(
            method,
            budget,
            max_new_tokens=NEW,
            temperature=temperature,
            seed=11 + index if temperature else None,
            prefill_chunk=16,
            **changes,
        )
        for index, (method, budget, temperature) in enumerate(MIXED)
    ]


class Collector:
    """Each request's Finished and its streamed tokens, by index."""

    def __init__(self) -> None:
        self.finished: dict[int, Finished] = {}
        self.streamed: dict[int, list[int]] = {}

    def request(self, index: int, prompt: list[int], cfg: GenerationConfig, **extra) -> Request:
        self.streamed[index] = []
        return Request(
            prompt,
            cfg,
            on_tokens=self.streamed[index].extend,
            on_finish=lambda done: self.finished.__setitem__(index, done),
            **extra,
        )

    def output(self, index: int) -> list[int]:
        done = self.finished[index]
        assert done.error is None, done.error
        assert done.result.output_ids == self.streamed[index]
        return done.result.output_ids


def scheduler(
    pair,
    slots: int,
    tokens: int = 64,
    prefix: PrefixCache | None = None,
    kv_tokens: int | None = None,
) -> Scheduler:
    """`kv_tokens`: an oversubscribed pool of that many tokens in blocks of PAGE."""
    target, drafter = pair
    block = PAGE if kv_tokens else BLOCK_TOKENS
    pool = CachePool(target, drafter, SLOT, prefix, block_tokens=block)
    return Scheduler(target, drafter, pool.slots(slots, kv_tokens), max_num_batched_tokens=tokens)


def drain(sched: Scheduler, limit: int = 1000) -> int:
    steps = 0
    while not sched.idle:
        sched.step()
        steps += 1
        assert steps < limit
    return steps


def solo(pair, prompt, cfg) -> list[int]:
    return generate(*pair, prompt, cfg).output_ids


def preempting_scheduler(pair, slots: int = 6, tokens: int = 24) -> Scheduler:
    """A scheduler over a pool too small for its slots at once (preemptions), beside a prefix
    cache of its blocks (8 blocks more)."""
    budget = 8 * sum(model.kv_layout().block_bytes(PAGE) for model in pair)
    prefix = PrefixCache(budget, recurrent=has_states(pair[0].new_cache(8)), block_tokens=PAGE)
    return scheduler(pair, slots, tokens=tokens, prefix=prefix, kv_tokens=POOL)


def assert_solo_outputs(sched: Scheduler, pair, cases: list, limit: int = 3000) -> None:
    """`cases` ((prompt, cfg) each, of MIXED's methods) added at once and drained: each output
    equals its solo run."""
    got = Collector()
    for index, case in enumerate(cases):
        sched.add(got.request(index, *case))
    drain(sched, limit=limit)
    for index, (prompt, cfg) in enumerate(cases):
        assert got.output(index) == solo(pair, prompt, cfg), MIXED[index]


def prefilled_caches(pair, lengths: list[int], room: int) -> list:
    """Slots of one scheduler's pools (their K/V blocks and GDN states shared), each target
    cache holding a random prompt of its length and the blocks of `room` more tokens; the pool's
    storage made for all of them (on the CPU it grows by doubling: a static pass over the
    storage before would be made again)."""
    target = pair[0]
    caches = [slot.cache for slot in CachePool(target, None, 64).slots(len(lengths))]
    for cache, ids in zip(caches, prompts(pair, lengths, seed=7), strict=True):
        target.extend(torch.tensor(ids), cache)
        getattr(cache, "kv", cache).check_room(room)
    getattr(caches[0], "kv", caches[0]).pool.padding_block()
    return caches
