"""The openai-agents SDK pointed at a local server: an agent's run, its weather tool and its
typed answer, as the Responses API tests use them.

    asked = []
    agent = Agent(name="weather", model="tiny", tools=[weather_tool(asked)])
    result = run_agent(url, agent, "Weather in Paris?")
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import openai
from agents import Agent, FunctionTool, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider
from agents.result import RunResultBase
from pydantic import BaseModel, Field

# Bounded, so a babbling model's constrained JSON ends within its max_tokens.
City = Annotated[str, Field(max_length=20)]


class Weather(BaseModel):
    """An agent's typed answer (`output_type`)."""

    city: City
    sky: Literal["sunny", "cloudy", "rain"]


def weather_tool(asked: list[str], *, once: bool = False) -> FunctionTool:
    """`get_weather`, which notes each city it is asked about and answers "sunny"; `once`: the
    agent is offered it until it has called it (a babbling model would call it forever)."""

    @function_tool(is_enabled=lambda context, agent: not (once and asked))
    def get_weather(city: City) -> str:
        """Current weather in a city."""
        asked.append(city)
        return "sunny"

    return get_weather


def run_agent(
    base_url: str, agent: Agent, question: str, *, streamed: bool = False, max_turns: int = 4
) -> RunResultBase:
    """Run `agent` against the server at `base_url` (the SDK's default Responses model, no
    tracing), whole or streamed."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)

    async def run() -> RunResultBase:
        if not streamed:
            return await Runner.run(agent, question, run_config=config, max_turns=max_turns)
        result = Runner.run_streamed(agent, question, run_config=config, max_turns=max_turns)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(run())
