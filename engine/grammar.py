"""Grammar-constrained decoding (structured output, forced tool calls) inside every method.

The grammar engine is llguidance (guidance-ai/llguidance, MIT; the engine vLLM, SGLang and
llama.cpp integrate, and OpenAI's structured outputs use). Chosen over xgrammar because:
its wheel (abi3, CPython >= 3.9) depends on nothing, where xgrammar's pulls torch, transformers,
triton, apache-tvm-ffi and pydantic into the engine's install; a grammar needs no compilation
against the vocabulary (a JSON schema over Qwen3.6's 248,320 tokens: ~1 ms for llguidance,
~27 ms for xgrammar, paid at every new schema's first token); a matcher forks (`deep_copy`,
~2 us) and rolls back, and checks a token without consuming it, which a draft tree needs. Its
mask per token is ~10 us at the median over that vocabulary (xgrammar's precomputed masks:
~3 us), far below a verify pass. A round's masks are computed one after another on the calling
thread: llguidance's thread pool (`LLExecutor`) cost more than it saved for 16 masks here.
Figures: engine/NOTES.md, measured by `python -m engine.tools.grammar_cost`.

The engine knows no tokenizer and no JSON schema: the server compiles the grammar with its
tokenizer (`Constraint.from_json_schema`, `Constraint.from_lark`) and passes the `Constraint` in
`GenerationConfig.constraint`. A sequence's `Guide` then keeps, for the round in flight:

    node 0      the grammar's state after the output so far (the bonus included);
    node i      a fork of node i's parent's state after node i's token: the tree build asks
                `allow(parent, token)` of every candidate, so the tree holds grammar-valid
                tokens only (a candidate that fails is skipped, its sibling tried next);
    masks       one allowed-token bitmask per verify index, each node's own state (computed
                while the verify pass runs on the device, applied to its logits after it);
    advance     node 0 becomes the last accepted node's state after the next bonus.

A stop token (the tokenizer's eos tokens, given to llguidance) is allowed exactly when the
grammar accepts, and it is the only token allowed once the grammar is complete, so generation
ends where the grammar does, as with `ar` under the same grammar.
"""

from __future__ import annotations

from collections.abc import Iterable

import llguidance
import numpy as np
import torch

COMPACT = {"whitespace_flexible": False}  # llguidance's JSON options: "," and ":" alone


class Constraint:
    """A compiled grammar over one tokenizer's vocabulary; hands out matchers for sequences."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.tokenizer, self.grammar = tokenizer, grammar
        # Compiled once: each sequence's matcher is a copy of this start state.
        self._start = llguidance.LLMatcher(tokenizer, grammar)
        if self._start.is_error():
            raise ValueError(f"grammar rejected: {self._start.get_error()}")
        self.vocab = tokenizer.vocab_size
        self.words = (self.vocab + 31) // 32  # int32 words of one bitmask
        self.stop_token_ids = tuple(tokenizer.eos_tokens)

    @classmethod
    def from_json_schema(cls, tokenizer: llguidance.LLTokenizer, schema: dict | str) -> Constraint:
        """JSON valid against `schema`, compact (no whitespace between its tokens: a model
        cannot loop on blanks, as a small or babbling one otherwise does)."""
        return cls(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema, COMPACT))

    @classmethod
    def from_lark(cls, tokenizer: llguidance.LLTokenizer, lark: str) -> Constraint:
        """llguidance's Lark-like grammar (may embed JSON schemas: `%json {...}`)."""
        return cls(tokenizer, llguidance.LLMatcher.grammar_from_lark(lark))

    def matcher(self) -> Matcher:
        return Matcher(self, self._start.deep_copy())


class Matcher:
    """The grammar's state after some tokens."""

    def __init__(self, constraint: Constraint, state: llguidance.LLMatcher) -> None:
        self.constraint, self.state = constraint, state
        self.ended = False  # a stop token was consumed: nothing that follows is output

    def allows(self, token: int) -> bool:
        if self.ended:
            return False
        if token in self.constraint.stop_token_ids:
            return self.state.is_accepting()
        return self.state.validate_tokens([token]) == 1

    def accept(self, token: int) -> None:
        if not self.ended and not self.state.consume_token(token):
            raise ValueError(f"token {token} breaks the grammar: {self.state.get_error()}")
        self.ended = self.ended or token in self.constraint.stop_token_ids

    def fork(self) -> Matcher:
        twin = Matcher(self.constraint, self.state.deep_copy())
        twin.ended = self.ended
        return twin


class Guide:
    """One sequence's grammar states for the round in flight (see the module docstring)."""

    def __init__(self, constraint: Constraint) -> None:
        self.constraint = constraint
        self.nodes = [constraint.matcher()]  # node 0: the state after the output so far

    def start_round(self) -> None:
        del self.nodes[1:]

    def allow(self, parent: int, token: int) -> bool:
        """The tree build's test of a candidate child of node `parent`: when the grammar allows
        it, the candidate becomes node len(nodes) with its own state."""
        if not self.nodes[parent].allows(token):
            return False
        child = self.nodes[parent].fork()
        child.accept(token)
        self.nodes.append(child)
        return True

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of a chain's tokens (below node 0) the grammar allows, each becoming a node."""
        for depth, token in enumerate(tokens):
            if not self.allow(depth, token):
                return depth
        return len(tokens)

    def masks(self, count: int) -> np.ndarray:  # [count, words] int32
        """Allowed-token bitmasks of nodes 0..count-1 (bit t of word t // 32 = token t). A node
        after a stop token allows everything: its choice is never output."""
        if count != len(self.nodes):
            raise ValueError(f"{count} masks asked of a tree of {len(self.nodes)} nodes")
        masks = np.full((count, self.constraint.words), -1, np.int32)
        for row, node in enumerate(self.nodes):
            if not node.ended:  # one after another: llguidance's thread pool costs more here
                node.state.unsafe_compute_mask_ptr(masks[row].ctypes.data, masks[row].nbytes)
        return masks

    def advance(self, accepted: list[int], next_token: int) -> None:
        """The output grew by the accepted nodes' tokens and the next bonus."""
        root = self.nodes[accepted[-1]]
        root.accept(next_token)
        self.nodes = [root]


def tokenizer_from_json(
    tokenizer_json: str, vocab: int, stop_token_ids: Iterable[int]
) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face tokenizer.json (its text), over the model's `vocab`
    logits (the model may pad its vocabulary past the tokenizer's), stopping at
    `stop_token_ids`. About two seconds for a 250k-token vocabulary: build it once per tokenizer."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=list(stop_token_ids))


def mask_logits(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [T, V] with -inf wherever the bitmasks [T, ceil(V / 32)] (int32, on the logits'
    device) clear the token's bit: unpacked on the device, no host read, static shapes."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (masks.unsqueeze(-1) >> shifts) & 1  # [T, words, 32]
    allowed = bits.view(masks.shape[0], -1)[:, : logits.shape[-1]].bool()
    return logits.masked_fill(~allowed, float("-inf"))
