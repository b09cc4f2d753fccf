"""`POST /v1/completions`: a prompt as text or token ids, continued (OpenAI's legacy API)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.grammar import Constraint
from engine.server.choices import ChoicesShape, serve_choices
from engine.server.generation import check_prompt_ids
from engine.server.schemas import CompletionRequest, parse_body
from engine.server.state import ServerState
from engine.server.structured import response_constraint

COMPLETIONS = ChoicesShape(
    "/v1/completions", "cmpl-", "text_completion", "text_completion", chat=False
)


def router(state: ServerState) -> APIRouter:
    async def completions(request: Request) -> Response:
        body, prompt_ids, constraint = await state.prepare(lambda raw: _prompt(state, raw), request)
        return await serve_choices(
            state, request, COMPLETIONS, body, prompt_ids, constraint=constraint
        )

    routes = APIRouter()
    routes.add_api_route(COMPLETIONS.endpoint, completions, methods=["POST"])
    return routes


def _prompt(
    state: ServerState, raw: bytes
) -> tuple[CompletionRequest, list[int], Constraint | None]:
    body = parse_body(CompletionRequest, raw)
    engine = state.ready_engine()
    if isinstance(body.prompt, str):
        prompt_ids = engine.tokenizer.encode(body.prompt)
    else:
        prompt_ids = list(body.prompt)
    check_prompt_ids(prompt_ids, engine.vocab_size)
    return body, prompt_ids, response_constraint(body.response_format, engine.grammar_tokenizer)
