"""`POST /v1/responses`: OpenAI's Responses API, the one agent SDKs speak, on chat's own path.

A request is translated into the chat completion it asks for (engine/server/response_input.py),
rendered by the chat template and generated exactly as `/v1/chat/completions` would; the output
is parsed by chat's `ChatOutput` (reasoning, content, tool calls) and dressed as Responses
output items (engine/server/response_output.py): `reasoning` from `<think>`, a `message`,
`function_call`s. Streamed (`"stream": true`), the answer is server-sent events:
`response.created`, `response.in_progress`, the items' events, then `response.completed`
(`response.incomplete` when `max_output_tokens` cut it, `response.failed` when the generation
failed). Nothing is stored: each request carries its whole conversation.

`usage` counts `input_tokens`, `output_tokens` and, of those, `reasoning_tokens` (the output up
to the end of `</think>`); `speculative` is the engine's statistics, as in chat.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.grammar import Constraint
from engine.server import generation as gen
from engine.server.chat import ChatOutput, ChatPrompt
from engine.server.chat_completions import chat_prompt
from engine.server.generation import Generation
from engine.server.logprobs import LogprobShapes
from engine.server.reasoning import THINK_CLOSE
from engine.server.response_input import ResponsesRequest, chat_request
from engine.server.response_output import OutputItems
from engine.server.schemas import ChatRequest, parse_body
from engine.server.state import ServerState
from engine.server.worker import Delta, Done, Failed

ENDPOINT = "/v1/responses"


def router(state: ServerState) -> APIRouter:
    async def responses(request: Request) -> Response:
        body, chat, prompt_ids, prompt, constraint, checkpoints = await state.prepare(
            lambda raw: _prompt(state, raw), request
        )
        (generation,) = gen.submit(
            state, ENDPOINT, "resp_", chat, prompt_ids, constraint, checkpoints
        )
        answer = _Answer(state, body, chat, generation, ChatOutput(prompt))
        if body.stream:
            return gen.event_stream([generation], answer.stream())
        return JSONResponse(answer.final(await gen.collect(request, generation)))

    routes = APIRouter()
    routes.add_api_route(ENDPOINT, responses, methods=["POST"])
    return routes


def _prompt(
    state: ServerState, raw: bytes
) -> tuple[
    ResponsesRequest, ChatRequest, list[int], ChatPrompt, Constraint | None, tuple[int, ...]
]:
    body = parse_body(ResponsesRequest, raw)
    chat = chat_request(body)
    return body, chat, *chat_prompt(state, chat)


@dataclass
class _Answer:
    """One generation, dressed as a Responses `response` object."""

    state: ServerState
    body: ResponsesRequest
    chat: ChatRequest
    generation: Generation
    output: ChatOutput

    def __post_init__(self) -> None:
        decode = self.state.ready_engine().tokenizer.decode
        self.items = OutputItems(LogprobShapes(decode) if self.chat.logprobs else None)
        self._waiting: tuple = ()  # logprobs of text the parsers still hold

    def final(self, collected: gen.Collected) -> dict:
        for event in collected.deltas:
            self._add(self.output.feed(event.text), event.logprobs)
        status = self._status(collected.done)
        self._add(self.output.finish(cut=status == "incomplete"))
        self.items.finish(status)
        return self._response(status, collected.done)

    def _add(self, deltas: list[dict], logprobs=()) -> list[dict]:
        """The items' events for a Delta's chat deltas (its logprobs ride on the first, or
        wait for the next delta when there is none)."""
        events, logprobs = [], (*self._waiting, *logprobs)
        self._waiting = () if deltas else logprobs
        for delta in deltas:
            calls = delta.get("tool_calls", [])
            complete = all(self.output.calls[call["index"]].complete for call in calls)
            events += self.items.add(delta, logprobs, complete)
            logprobs = ()
        return events

    async def stream(self) -> AsyncIterator[str]:
        sequence = 0

        def event(payload: dict) -> str:
            nonlocal sequence
            sequence += 1
            return gen.sse({**payload, "sequence_number": sequence - 1}, payload["type"])

        snapshot = self._response("in_progress")
        yield event({"type": "response.created", "response": snapshot})
        yield event({"type": "response.in_progress", "response": snapshot})
        async for happened in gen.events(self.generation):
            if isinstance(happened, Delta):
                for payload in self._add(self.output.feed(happened.text), happened.logprobs):
                    yield event(payload)
            elif isinstance(happened, Failed):
                self.state.count_error(ENDPOINT, happened.status)
                failed = self._response("failed", error=happened.message)
                yield event({"type": "response.failed", "response": failed})
            elif happened.result is not None:
                status = self._status(happened)
                for payload in self._add(self.output.finish(cut=status == "incomplete")):
                    yield event(payload)
                for payload in self.items.finish(status):
                    yield event(payload)
                if status != "cancelled":  # else the client has gone
                    final = self._response(status, happened)
                    yield event({"type": f"response.{status}", "response": final})

    def _status(self, done: Done) -> str:
        finish = gen.finish_reason(self.generation, done.result)
        return {"length": "incomplete", "cancelled": "cancelled"}.get(finish, "completed")

    def _response(self, status: str, done: Done | None = None, error: str | None = None) -> dict:
        body, chat, extra = self.body, self.chat, self.body.model_extra or {}
        text_format = (body.text and body.text.format) or {"type": "text"}
        return {
            "id": self.generation.id,
            "object": "response",
            "created_at": self.generation.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": {"code": "server_error", "message": error} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.instructions,
            "model": self.state.config.model_name,
            "output": self.items.items if done is not None else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": body.tool_choice or "auto",
            "tools": [_echoed_tool(tool) for tool in body.tools or []],
            "text": {"format": text_format},
            "reasoning": {"effort": None, "summary": None},
            "temperature": chat.temperature,
            "top_p": chat.top_p,
            "top_logprobs": body.top_logprobs,
            "max_output_tokens": body.max_output_tokens,
            "metadata": extra.get("metadata") or {},
            "previous_response_id": None,
            "store": False,
            "truncation": "disabled",
            "background": False,
            "service_tier": "default",
            **({"user": extra["user"]} if extra.get("user") is not None else {}),
            **(self._statistics(done) if done is not None else {}),
        }

    def _statistics(self, done: Done) -> dict:
        usage = self._usage(done)
        return {"usage": usage, "speculative": gen.speculative_stats(self.generation, done)}

    def _usage(self, done: Done) -> dict:
        usage = gen.usage(self.generation, done.result)
        return {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "cache_write_tokens": 0,  # the spec's field; the prefix cache's writes go uncounted
            },
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(done.result)},
            "total_tokens": usage["total_tokens"],
        }

    def _reasoning_tokens(self, result: Any) -> int:
        """The output's tokens up to the end of `</think>` (all of them if it never closed)."""
        if result is None or not any(i["type"] == "reasoning" for i in self.items.items):
            return 0
        ids = result.output_ids
        close = self.state.ready_engine().tokenizer.encode(THINK_CLOSE)
        starts = (i for i in range(len(ids) - len(close) + 1) if ids[i : i + len(close)] == close)
        end = next(starts, None)
        return len(ids) if end is None else end + len(close)


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as a response lists it: every field present, null when not given."""
    fields = ("name", "description", "parameters", "strict")
    return {"type": "function", **{name: tool.get(name) for name in fields}}
