"""The OpenAI Agents SDK (openai-agents), unmodified, against `pagedkv up` on the packaged SmolLM2
GGUF through its Chat Completions model: an agent with a function tool under tool_choice auto runs
the round trip (call, the tool's result sent back with the tool still bound, a text answer from
it); under tool_choice required it calls, and the SDK's reset to auto lets it answer; an output
type comes back validated (response_format json_schema); a streamed run reports usage."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import BaseModel, Field

from tests.clients.conftest import CALL_PROMPT, MAX_TOKENS, WEATHER_RESULT

agents = pytest.importorskip("agents")
pytestmark = pytest.mark.timeout(600)


class Weather(BaseModel):
    city: str = Field(max_length=24)


def model(url: str, name: str) -> Any:
    """A model on a fresh client: an async client belongs to the event loop that first used it,
    and each run below has its own."""
    import openai

    agents.set_tracing_disabled(True)  # no traces sent to OpenAI
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    return agents.OpenAIChatCompletionsModel(model=name, openai_client=client)


def weather_tool() -> Any:
    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather in a city"""
        return WEATHER_RESULT

    return get_weather


def kinds(result: Any) -> list[str]:
    return [type(item).__name__ for item in result.new_items]


@pytest.mark.parametrize(("choice", "prompt"), [(None, CALL_PROMPT), ("required", "Weather in Paris?")])
def test_a_tool_round_trip(smollm2_url: str, model_name: str, choice: str | None, prompt: str) -> None:
    agent = agents.Agent(
        name="weather",
        tools=[weather_tool()],
        model=model(smollm2_url, model_name),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS, tool_choice=choice),
    )
    result = agents.Runner.run_sync(agent, prompt, max_turns=4)
    got = kinds(result)
    assert got[0] == "ToolCallItem" and "ToolCallOutputItem" in got and got[-1] == "MessageOutputItem", got
    call = result.new_items[0].raw_item
    assert call.name == "get_weather" and '"city"' in call.arguments
    outputs = [i.output for i in result.new_items if type(i).__name__ == "ToolCallOutputItem"]
    assert outputs and all(o == WEATHER_RESULT for o in outputs)
    assert isinstance(result.final_output, str) and WEATHER_RESULT in result.final_output


def test_an_output_type(smollm2_url: str, model_name: str) -> None:
    agent = agents.Agent(
        name="weather",
        model=model(smollm2_url, model_name),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS),
        output_type=Weather,
    )
    got = agents.Runner.run_sync(agent, "What is the weather in Paris?").final_output
    assert isinstance(got, Weather) and got.city


def test_a_streamed_run_reports_usage(smollm2_url: str, model_name: str) -> None:
    async def run() -> Any:
        agent = agents.Agent(
            name="plain",
            model=model(smollm2_url, model_name),
            model_settings=agents.ModelSettings(temperature=0, max_tokens=12, include_usage=True),
        )
        result = agents.Runner.run_streamed(agent, "What is the capital of France?")
        deltas = [e async for e in result.stream_events() if e.type == "raw_response_event"]
        return result, deltas

    result, deltas = asyncio.run(run())
    assert len(deltas) > 2 and "Paris" in result.final_output
    usage = result.context_wrapper.usage
    assert usage.requests == 1 and usage.input_tokens > 0 and 0 < usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
