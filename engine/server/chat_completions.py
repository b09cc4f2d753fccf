"""`POST /v1/chat/completions`: messages and tools rendered with the model's chat template; the
output parsed back into content, `reasoning_content` and `tool_calls` (engine/server/chat.py).

With a prefix cache, the prompt's token where the messages end (before the generation prompt) is
a checkpoint: a next turn re-renders the messages the same but the generation prompt perhaps
not (Qwen3's empty think block), so it resumes there."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.grammar import Constraint
from engine.prefix_cache import messages_end
from engine.server.chat import ChatOutput, ChatPrompt, build_chat_prompt
from engine.server.choices import ChoicesShape, serve_choices
from engine.server.generation import check_prompt_ids
from engine.server.schemas import ChatRequest, parse_body
from engine.server.state import ServerState
from engine.server.structured import chat_constraint

CHAT_COMPLETIONS = ChoicesShape(
    "/v1/chat/completions", "chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True
)


def router(state: ServerState) -> APIRouter:
    async def chat_completions(request: Request) -> Response:
        body, prompt_ids, chat, constraint, checkpoints = await state.prepare(
            lambda raw: _prompt(state, raw), request
        )
        output = lambda: ChatOutput(chat)  # noqa: E731  # one parser per sequence
        return await serve_choices(
            state, request, CHAT_COMPLETIONS, body, prompt_ids, output, constraint, checkpoints
        )

    routes = APIRouter()
    routes.add_api_route(CHAT_COMPLETIONS.endpoint, chat_completions, methods=["POST"])
    return routes


def _prompt(
    state: ServerState, raw: bytes
) -> tuple[ChatRequest, list[int], ChatPrompt, Constraint | None, tuple[int, ...]]:
    body = parse_body(ChatRequest, raw)
    return body, *chat_prompt(state, body)


def chat_prompt(
    state: ServerState, body: ChatRequest
) -> tuple[list[int], ChatPrompt, Constraint | None, tuple[int, ...]]:
    """The request's conversation rendered with the chat template, its token ids, the grammar
    its output follows (engine/server/structured.py), if any, and with a prefix cache the
    prompt position where the messages end (a checkpoint, see the module docstring)."""
    engine = state.ready_engine()
    structured = body.response_format is not None and body.response_format.type != "text"
    cached = engine.prefix_caching and body.cache_prompt
    chat = build_chat_prompt(body, engine.tokenizer, state.parsing, structured, cached)
    prompt_ids = engine.tokenizer.encode(chat.text)
    check_prompt_ids(prompt_ids, engine.vocab_size)
    constraint = chat_constraint(chat, body.response_format, engine.grammar_tokenizer)
    checkpoints = ()
    if chat.history is not None:  # where the messages end: a next turn resumes there
        checkpoints = (messages_end(prompt_ids, chat.text, chat.history, engine.tokenizer.encode),)
    return prompt_ids, chat, constraint, checkpoints
