"""The `choices`-shaped answers of completions and chat completions, whole or streamed.

Both APIs answer an object with `choices` (a text, or an assistant message), `usage` and
`speculative`; streamed, a chunk per delta, a last chunk with the finish_reason and the
speculative statistics, a usage chunk if asked (`stream_options.include_usage`), then
`data: [DONE]`. A `ChoicesShape` says how one endpoint dresses its output; chat's text passes
through a `ChatOutput` (content, reasoning and tool-call deltas).

A request's `n` sequences (engine/server/generation.py's `submit`) are its choices, each with
its `index`; streamed, their chunks come as they are made. Completions' `best_of` makes more and
returns the n with the highest log-probability per token; `echo` puts the prompt first (with
its logprobs when `logprobs` asks). Logprobs (engine/server/logprobs.py) ride with the text
they belong to: each chunk carries those of the tokens behind its delta.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.grammar import Constraint
from engine.server import generation as gen
from engine.server.chat import ChatOutput
from engine.server.generation import Collected, Generation
from engine.server.logprobs import LogprobShapes, mean_logprob
from engine.server.state import ServerState
from engine.server.worker import Delta, Done, Failed


@dataclass(frozen=True)
class ChoicesShape:
    """How one endpoint dresses output into OpenAI objects (completions vs chat completions)."""

    endpoint: str
    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, index: int, output: str | dict, finish: str | None, logprobs=None) -> dict:
        """`output`: the text (completions) or the assistant message (chat)."""
        body = {"message": output} if self.chat else {"text": output}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish}

    def chunk_choice(
        self, index: int, output: str | dict, finish: str | None, logprobs=None
    ) -> dict:
        """`output`: a text delta (completions) or a message delta (chat)."""
        body = {"delta": output} if self.chat else {"text": output}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish}


async def serve_choices(
    state: ServerState,
    request: Request,
    shape: ChoicesShape,
    body: Any,
    prompt_ids: list[int],
    output: Callable[[], ChatOutput] | None = None,
    constraint: Constraint | None = None,
    checkpoints: tuple[int, ...] = (),
) -> Response:
    """Run the request through the shared generation path and answer it in `shape`
    (`output`: makes each sequence's ChatOutput; `checkpoints`: prompt positions the prefix
    cache snapshots at, see engine/decode.py)."""
    generations = gen.submit(
        state, shape.endpoint, shape.id_prefix, body, prompt_ids, constraint, checkpoints
    )
    answer = _Answer(state, shape, body, prompt_ids, generations, output)
    if body.stream:
        return gen.event_stream(generations, answer.stream())
    return JSONResponse(answer.final_body(await gen.collect_all(request, generations)))


class _Answer:
    """A request's generations (one per sequence), dressed in `shape`."""

    def __init__(
        self,
        state: ServerState,
        shape: ChoicesShape,
        body: Any,
        prompt_ids: list[int],
        generations: list[Generation],
        output: Callable[[], ChatOutput] | None,
    ) -> None:
        self.state, self.shape, self.body = state, shape, body
        self.prompt_ids, self.generations = prompt_ids, generations
        self.first = generations[0]
        # chat: text -> content, reasoning and tool-call deltas, one parser per sequence
        self.outputs = [output() if output else None for _ in generations]
        self.decode = state.ready_engine().tokenizer.decode
        self.shapes = LogprobShapes(self.decode)
        self.logprobs = body.output_logprobs() is not None  # asked: shown
        self.echo = getattr(body, "echo", False)
        self.offsets = [0] * len(generations)  # completions: each text's length so far

    # -- streamed ------------------------------------------------------------------------------

    async def stream(self) -> AsyncIterator[str]:
        shape, pending = self.shape, {g.index: [] for g in self.generations}
        for generation in self.generations:
            if shape.chat:
                first = {"role": "assistant", "content": "", "refusal": None}
                yield gen.sse(self._chunk(shape.chunk_choice(generation.index, first, None)))
            elif self.echo:
                yield gen.sse(self._chunk(self._text_choice(generation, self._prompt_text(), ())))
        results = {}
        async for generation, event in gen.merged_events(self.generations):
            if isinstance(event, Delta) and generation.silent:
                continue  # max_tokens 0: nothing of the output is shown
            if isinstance(event, Delta):
                pending[generation.index] += event.logprobs
                for choice in self._delta_choices(generation, event.text, pending):
                    yield gen.sse(self._chunk(choice))
            elif isinstance(event, Failed):
                self.state.count_error(shape.endpoint, event.status)
                yield gen.sse(gen.failure(event).body())
            elif event.result is not None:
                results[generation.index] = event.result
                for chunk in self._final_chunks(generation, event, pending):
                    yield gen.sse(chunk)
        if self.first.include_usage and results:
            usage = gen.usage(self.first, *results.values())
            yield gen.sse(self._chunk(None, usage=usage))
        yield "data: [DONE]\n\n"

    def _delta_choices(self, generation: Generation, text: str, pending: dict) -> list[dict]:
        """A Delta's chunk choices; the logprobs so far ride on the first (else they wait)."""
        index = generation.index
        if not self.shape.chat:
            choice = self._text_choice(generation, text, pending[index])
            pending[index] = []
            return [choice]
        choices = []
        for delta in self.outputs[index].feed(text):
            logprobs = self._chat_logprobs(pending[index])
            pending[index] = []
            choices.append(self.shape.chunk_choice(index, delta, None, logprobs))
        return choices

    def _text_choice(self, generation: Generation, text: str, entries) -> dict:
        index = generation.index
        logprobs = None
        if self.logprobs:
            tokens = [entry.token for entry in entries]
            logprobs = self.shapes.completion(tokens, entries, self.offsets[index])
        self.offsets[index] += len(text)
        return self.shape.chunk_choice(index, text, None, logprobs)

    def _final_chunks(self, generation: Generation, done: Done, pending: dict) -> list[dict]:
        shape, index = self.shape, generation.index
        finish = "length" if generation.silent else gen.finish_reason(generation, done.result)
        chunks = []
        output = self.outputs[index]
        if output is not None:
            for delta in output.finish(cut=finish == "length"):
                logprobs = self._chat_logprobs(pending[index])
                pending[index] = []
                chunks.append(self._chunk(shape.chunk_choice(index, delta, None, logprobs)))
        if shape.chat:
            last = shape.chunk_choice(index, {}, None, self._chat_logprobs(pending[index]))
        else:
            last = self._text_choice(generation, "", pending[index])
        last["finish_reason"] = self._finish_reason(index, finish)
        stats = gen.speculative_stats(generation, done)
        chunks.append(self._chunk(last, speculative=stats))
        return chunks

    # -- whole ---------------------------------------------------------------------------------

    def final_body(self, collected: list[Collected]) -> dict:
        ranked = list(zip(self.generations, collected, strict=True))
        if len(ranked) > self.body.n:  # best_of: the n most likely per token
            ranked.sort(key=lambda pair: mean_logprob(pair[1].logprobs), reverse=True)
            ranked = ranked[: self.body.n]
        choices = [self._choice(i, *pair) for i, pair in enumerate(ranked)]
        results = [c.done.result for c in collected]
        return {
            "id": self.first.id,
            "object": self.shape.object,
            "created": self.first.created,
            "model": self.state.config.model_name,
            "choices": choices,
            "usage": gen.usage(self.first, *results),
            "speculative": gen.speculative_stats(ranked[0][0], ranked[0][1].done),
        }

    def _choice(self, index: int, generation: Generation, collected: Collected) -> dict:
        result = collected.done.result
        finish = gen.finish_reason(generation, result)
        if generation.silent:  # max_tokens 0: the prompt alone
            collected, finish = Collected([], collected.done), "length"
        output = self.outputs[generation.index]
        if output is None:
            text, logprobs = self._completion(collected)
            return self.shape.choice(index, text, finish, logprobs)
        deltas = output.feed(collected.text) + output.finish(cut=finish == "length")
        message = output.message(deltas)
        finish = self._finish_reason(generation.index, finish)
        return self.shape.choice(index, message, finish, self._chat_logprobs(collected.logprobs))

    def _completion(self, collected: Collected) -> tuple[str, dict | None]:
        """A completion's text and legacy logprobs (the prompt's first, with echo)."""
        entries, text = list(collected.logprobs), collected.text
        tokens = [entry.token for entry in entries]
        if self.echo:
            text = self._prompt_text() + text
            result = collected.done.result
            prompt = result.prompt_logprobs if result and result.prompt_logprobs else None
            entries = (prompt or [None] * len(self.prompt_ids)) + entries
            tokens = self.prompt_ids + tokens
        if not self.logprobs:
            return text, None
        return text, self.shapes.completion(tokens, entries)

    # -- pieces --------------------------------------------------------------------------------

    def _prompt_text(self) -> str:
        prompt = self.body.prompt
        return prompt if isinstance(prompt, str) else self.decode(self.prompt_ids)

    def _chat_logprobs(self, entries) -> dict | None:
        if not self.logprobs:
            return None
        return {"content": self.shapes.chat(entries), "refusal": None}

    def _chunk(self, choice: dict | None, **extra) -> dict:
        return {
            "id": self.first.id,
            "object": self.shape.chunk_object,
            "created": self.first.created,
            "model": self.state.config.model_name,
            "choices": [choice] if choice else [],
            **extra,
        }

    def _finish_reason(self, index: int, finish: str) -> str:
        """ "tool_calls" when a finished turn called tools."""
        output = self.outputs[index]
        calls = output is not None and output.calls
        return "tool_calls" if finish == "stop" and calls else finish
