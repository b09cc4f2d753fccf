"""The `choices`-shaped answers of completions and chat completions, whole or streamed.

Both APIs answer an object with `choices` (a text, or an assistant message), `usage` and
`speculative`; streamed, a chunk per delta, a last chunk with the finish_reason and the
speculative statistics, a usage chunk if asked (`stream_options.include_usage`), then
`data: [DONE]`. A `ChoicesShape` says how one endpoint dresses its output; chat's text passes
through a `ChatOutput` (content, reasoning and tool-call deltas).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.grammar import Constraint
from engine.server import generation as gen
from engine.server.chat import ChatOutput
from engine.server.generation import Generation
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

    def choice(self, output: str | dict, finish: str | None) -> dict:
        """`output`: the text (completions) or the assistant message (chat)."""
        body = {"message": output} if self.chat else {"text": output}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish}

    def chunk_choice(self, output: str | dict, finish: str | None) -> dict:
        """`output`: a text delta (completions) or a message delta (chat)."""
        body = {"delta": output} if self.chat else {"text": output}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish}


async def serve_choices(
    state: ServerState,
    request: Request,
    shape: ChoicesShape,
    body: Any,
    prompt_ids: list[int],
    output: ChatOutput | None = None,
    constraint: Constraint | None = None,
    checkpoints: tuple[int, ...] = (),
) -> Response:
    """Run the request through the shared generation path and answer it in `shape`
    (`checkpoints`: prompt positions the prefix cache snapshots at, see engine/decode.py)."""
    generation = gen.submit(
        state, shape.endpoint, shape.id_prefix, body, prompt_ids, constraint, checkpoints
    )
    answer = _Answer(state, shape, generation, output)
    if body.stream:
        return gen.event_stream(answer.generation, answer.stream())
    text, done = await gen.collect(request, answer.generation)
    return JSONResponse(answer.final_body(text, done))


@dataclass
class _Answer:
    """One generation, dressed in `shape`."""

    state: ServerState
    shape: ChoicesShape
    generation: Generation
    output: ChatOutput | None  # chat: text -> content, reasoning and tool-call deltas

    async def stream(self) -> AsyncIterator[str]:
        shape = self.shape
        if shape.chat:
            first = {"role": "assistant", "content": "", "refusal": None}
            yield gen.sse(self._chunk(shape.chunk_choice(first, None)))
        async for event in gen.events(self.generation):
            if isinstance(event, Delta):
                for delta in self._deltas(event.text):
                    yield gen.sse(self._chunk(shape.chunk_choice(delta, None)))
            elif isinstance(event, Failed):
                self.state.count_error(shape.endpoint, event.status)
                yield gen.sse(gen.failure(event).body())
            elif event.result is not None:
                for chunk in self._final_chunks(event):
                    yield gen.sse(chunk)
        yield "data: [DONE]\n\n"

    def final_body(self, text: str, done: Done) -> dict:
        result = done.result
        output: str | dict = text
        if self.output is not None:
            deltas = self.output.feed(text) + self.output.finish()
            output = self.output.message(deltas)
        return {
            "id": self.generation.id,
            "object": self.shape.object,
            "created": self.generation.created,
            "model": self.state.config.model_name,
            "choices": [self.shape.choice(output, self._finish_reason(result))],
            "usage": gen.usage(self.generation, result),
            "speculative": gen.speculative_stats(self.generation, done),
        }

    def _chunk(self, choice: dict | None, **extra) -> dict:
        return {
            "id": self.generation.id,
            "object": self.shape.chunk_object,
            "created": self.generation.created,
            "model": self.state.config.model_name,
            "choices": [choice] if choice else [],
            **extra,
        }

    def _final_chunks(self, done: Done) -> list[dict]:
        shape = self.shape
        chunks = []
        if self.output is not None:
            for delta in self.output.finish():
                chunks.append(self._chunk(shape.chunk_choice(delta, None)))
        finish = self._finish_reason(done.result)
        choice = shape.chunk_choice({} if shape.chat else "", finish)
        stats = gen.speculative_stats(self.generation, done)
        chunks.append(self._chunk(choice, speculative=stats))
        if self.generation.include_usage:
            chunks.append(self._chunk(None, usage=gen.usage(self.generation, done.result)))
        return chunks

    def _deltas(self, text: str) -> list[str | dict]:
        """A text delta as the stream's choice deltas: itself, or chat message deltas."""
        if self.output is None:
            return [text]
        return self.output.feed(text)

    def _finish_reason(self, result: Any) -> str:
        """ "tool_calls" when a finished turn called tools."""
        finish = gen.finish_reason(self.generation, result)
        calls = self.output is not None and self.output.calls
        return "tool_calls" if finish == "stop" and calls else finish
