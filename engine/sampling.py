"""The target's choice of token at each position: argmax at temperature 0, else a seeded sample,
after the request's grammar mask, penalties and warps.

Speculative decoding stays lossless because every committed token is exactly this choice,
made at the token's own position given its own path (see engine/tree.py's walk): a verify
position's penalties count the output so far plus the draft tokens on that position's path, and
its grammar mask is the grammar's state after that path (engine/grammar.py).

Order, as vLLM applies them: grammar mask, penalties (repetition, then frequency and presence),
OpenAI's `logit_bias` (added to its tokens' logits), temperature, then top_k, top_p and min_p.
Penalties (OpenAI's and vLLM's definitions): `presence_penalty` is subtracted from the logit of
every token already in the output, `frequency_penalty` times its count; `repetition_penalty`
(the CTRL / Hugging Face one) divides a positive logit of a token seen in the prompt or the
output by it and multiplies a negative one. Greedy decoding applies the mask and the penalties
(they move the argmax); the warps never change the argmax, so they act only when sampling.

On the device everything runs with static shapes and without reading anything back: the output's
counts live on the device and grow by non-blocking copies of each round's tokens.

Logprobs (OpenAI's `logprobs` / `top_logprobs`), when asked: a chosen token's log-probability
under the distribution it was drawn from (after the mask, the penalties and, when sampling, the
temperature and warps; a token the warps dropped has -inf), with the `top` most likely tokens of
that distribution. They are computed beside the choice on the device and read back with it in
the one read a round already makes (`choose_scored`, `read_scored`), so each method's logprobs
are the target's own at the token's own path: equal across ar, linear and ddtree. The prompt's
(`PromptScores`, completions' `echo`) are the raw log-softmax of the target's logits at each
position, gathered chunk by chunk during the prefill, read back once at its end.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.transfer import to_device

_BIASES = "token ids >= 0 with biases in [-100, 100]"


@dataclass(frozen=True)
class Sampling:
    """Warps beyond temperature; the defaults ask for nothing."""

    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p (0: one)
    top_k: int = 0  # keep the k most likely tokens (0: all)
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    presence_penalty: float = 0.0  # -2..2
    frequency_penalty: float = 0.0  # -2..2
    repetition_penalty: float = 1.0  # > 0; 1 = none
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, -100..100) added to its logit

    def __post_init__(self) -> None:
        problems = [
            ("top_p", 0 <= self.top_p <= 1, "in [0, 1]"),
            ("top_k", self.top_k >= 0, ">= 0 (0 = off)"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("logit_bias", all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias), _BIASES),
        ]
        for name, ok, rule in problems:
            if not ok:
                raise ValueError(f"{name} must be {rule}, not {getattr(self, name)!r}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1


NO_SAMPLING = Sampling()


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


MAX_TOP_LOGPROBS = 20  # OpenAI's most alternatives per token


@dataclass(frozen=True)
class TokenLogprob:
    """A token, its log-probability, and the `top` most likely tokens (id, logprob) of the same
    distribution, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def choose(
    logits: torch.Tensor,  # [T, V] float32
    temperature: float,
    generator: torch.Generator | None = None,
    sampling: Sampling = NO_SAMPLING,
) -> torch.Tensor:  # [T] int64
    """argmax when temperature is 0, else one sample per row from the warped softmax(logits / T)."""
    return choose_scored(logits, temperature, generator, sampling)[0]


def greedy(logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [...] int64
    """argmax over the last dimension (the first of equal maxima, NaN counted largest, as
    `argmax`), by `max`: on the CPU `argmax` takes 2.6x as long (49.5 against 19.0 us for a
    16-node tree's [16, 2048] logits, one thread), paid by every verify and linear draft."""
    return logits.max(dim=-1).indices


def choose_scored(
    logits: torch.Tensor,  # [T, V] float32 (float64 for float64 models)
    temperature: float,
    generator: torch.Generator | None = None,
    sampling: Sampling = NO_SAMPLING,
    top: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [T] int64, [T, 1 + 2 top]
    """`choose`'s choices and, when `top` is not None, their scores on the device: per row the
    choice's logprob, then the `top` most likely token ids and their logprobs (ids as floats:
    exact below 2^24, far above any vocabulary), all of the distribution the choice came from."""
    logits = biased(logits, sampling)
    if temperature == 0:
        choices = greedy(logits)
        return choices, None if top is None else _scores(logits.log_softmax(-1), choices, top)
    scaled = logits.float() / temperature
    probs = warped_probs(scaled, sampling)
    choices = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if top is None:
        return choices, None
    kept = scaled.masked_fill(probs == 0, float("-inf"))  # what the warps dropped: -inf
    return choices, _scores(kept.log_softmax(-1), choices, top)


def biased(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:  # [T, V]
    """logits with the request's logit_bias added (its vector made once per bias, device and
    width, by a non-blocking copy: nothing is read back)."""
    if not sampling.logit_bias:
        return logits
    return logits + _bias_vector(sampling.logit_bias, logits.shape[-1], logits.device, logits.dtype)


@functools.lru_cache(maxsize=16)
def _bias_vector(
    bias: tuple[tuple[int, float], ...], vocab: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:  # [V]
    ids, values = zip(*bias, strict=True)
    vector = torch.zeros(vocab, dtype=dtype, device=device)
    values_on_device = to_device(np.asarray(values, np.float64), device).to(dtype)
    vector[to_device(np.asarray(ids, np.int64), device)] = values_on_device
    return vector


def _scores(log_probs: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """[T, 1 + 2 top]: log_probs [T, V] at `tokens` [T], then its `top` best ids and values."""
    chosen = log_probs.gather(-1, tokens.unsqueeze(-1))
    best = log_probs.topk(top, dim=-1)
    return torch.cat([chosen, best.indices.to(log_probs.dtype), best.values], dim=-1)


def read_scored(
    choices: torch.Tensor, scores: torch.Tensor | None
) -> tuple[list[int], list[TokenLogprob] | None]:
    """The choices and their logprobs on the host, in one read of the device."""
    if scores is None:
        return choices.tolist(), None
    rows = torch.cat([choices.unsqueeze(-1).to(scores.dtype), scores], dim=-1).tolist()
    return [int(row[0]) for row in rows], [_token_logprob(row[0], row[1:]) for row in rows]


def read_scored_together(
    scored: list[tuple[torch.Tensor, torch.Tensor | None]],
) -> list[tuple[list[int], list[TokenLogprob] | None]]:
    """`read_scored` of several sequences' (choices [T_i], scores [T_i, 1 + 2 top_i] or None) in
    one read of the device for them all (a batched step's: not one a sequence). With scores,
    every value travels as float64 (token ids exactly, float32 logprobs unchanged)."""
    if not scored:
        return []
    if all(scores is None for _, scores in scored):
        ids = torch.cat([choices for choices, _ in scored]).tolist()
        bounds = [0, *itertools.accumulate(choices.shape[0] for choices, _ in scored)]
        return [(ids[a:b], None) for a, b in itertools.pairwise(bounds)]
    rows = [
        torch.cat([choices.unsqueeze(-1).to(torch.float64), scores.to(torch.float64)], dim=-1)
        if scores is not None
        else choices.unsqueeze(-1).to(torch.float64)
        for choices, scores in scored
    ]
    values, out, at = torch.cat([row.flatten() for row in rows]).tolist(), [], 0
    for row in rows:
        T, width = row.shape
        mine = [values[at + i * width : at + (i + 1) * width] for i in range(T)]
        logprobs = [_token_logprob(r[0], r[1:]) for r in mine] if width > 1 else None
        out.append(([int(r[0]) for r in mine], logprobs))
        at += T * width
    return out


def _token_logprob(token: float, scores: list[float]) -> TokenLogprob:
    top = (len(scores) - 1) // 2
    ids, values = scores[1 : 1 + top], scores[1 + top :]
    return TokenLogprob(int(token), scores[0], tuple(zip(map(int, ids), values, strict=True)))


class PromptScores:
    """The prompt's logprobs (position 0 has none), gathered during the prefill: `at(start)` is
    the target's `score` for the chunk starting at prompt position `start` (see
    engine/models/common.py's `score_positions`); a row's logits score the next prompt token."""

    def __init__(self, prompt_ids: list[int], top: int, device: torch.device) -> None:
        self.prompt, self.top = prompt_ids, top
        self.ids = to_device(np.asarray(prompt_ids, np.int64), device)
        self.rows: list[torch.Tensor] = []  # [n, 1 + 2 top] on the device, in prompt order

    def at(self, start: int) -> Callable[[int, torch.Tensor], None]:
        def score(first: int, logits: torch.Tensor) -> None:
            begin = start + first  # the prompt position of logits' first row
            rows = min(logits.shape[0], len(self.prompt) - 1 - begin)  # the last predicts output
            if rows > 0:
                following = self.ids[begin + 1 : begin + 1 + rows]
                log_probs = logits[:rows].log_softmax(-1)
                self.rows.append(_scores(log_probs, following, self.top))

        return score

    def read(self) -> list[TokenLogprob | None]:
        """Every prompt token's logprob (None for the first), in one read of the device."""
        if not self.rows:
            return [None] * len(self.prompt)
        rows = torch.cat(self.rows).tolist()
        scored = [_token_logprob(t, row) for t, row in zip(self.prompt[1:], rows, strict=True)]
        return [None, *scored]


def warped_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:  # [T, V]
    """softmax(logits) restricted by top_k, then top_p, then min_p, renormalised."""
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
        drop_sorted = before >= sampling.top_p
        drop_sorted[..., 0] = False  # the most likely token is always kept (top_p 0: it alone)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if sampling.min_p > 0:
        threshold = sampling.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


class Penalties:
    """The output's token counts (and the prompt's tokens, for repetition_penalty) on the device,
    applied per verify position with the draft tokens on that position's path added."""

    def __init__(self, sampling: Sampling, vocab: int, device: torch.device) -> None:
        self.sampling, self.vocab, self.device = sampling, vocab, device
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)  # prompt or output

    def start(self, prompt_ids: list[int]) -> None:
        if self.sampling.repetition_penalty != 1:
            self.seen[to_device(np.asarray(prompt_ids, np.int64), self.device)] = True

    def add(self, tokens: list[int]) -> None:
        """Tokens that joined the output."""
        ids = to_device(np.asarray(tokens, np.int64), self.device)
        self.counts.index_add_(0, ids, torch.ones(len(tokens), device=self.device))
        self.seen[ids] = True

    def apply(self, logits: torch.Tensor, paths: list[list[int]] | None = None) -> torch.Tensor:
        """logits [T, V] penalised; paths[i]: the draft tokens between the output and row i."""
        counts = self.counts.expand(logits.shape[0], -1)
        if paths and any(paths):
            counts = counts + self._path_counts(paths)
        s = self.sampling
        if s.repetition_penalty != 1:
            seen = self.seen | (counts > 0)
            scaled = torch.where(
                logits > 0, logits / s.repetition_penalty, logits * s.repetition_penalty
            )
            logits = torch.where(seen, scaled, logits)
        return logits - s.presence_penalty * (counts > 0) - s.frequency_penalty * counts

    def _path_counts(self, paths: list[list[int]]) -> torch.Tensor:  # [T, V]
        longest = max(len(path) for path in paths)
        ids = np.full((len(paths), longest), self.vocab, np.int64)  # vocab: a column dropped
        for row, path in enumerate(paths):
            ids[row, : len(path)] = path
        index = to_device(ids, self.device)
        counts = torch.zeros(len(paths), self.vocab + 1, device=self.device)
        counts.scatter_add_(1, index, torch.ones(index.shape, device=self.device))
        return counts[:, : self.vocab]
