"""LangChain's OpenAI chat model (langchain-openai's ChatOpenAI), unmodified, against `pagedkv up` on
the packaged SmolLM2 GGUF: a required and a named tool call with arguments valid for the tool, a
structured output parsed into a pydantic model, usage on a streamed answer, and the round trip with
tool_choice auto (call, ToolMessage back with the tools still bound, a text answer from it)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, Field

from tests.clients.conftest import CALL_PROMPT, MAX_TOKENS, WEATHER_RESULT

pytest.importorskip("langchain_openai")
pytestmark = pytest.mark.timeout(600)


class Weather(BaseModel):
    city: str = Field(max_length=24)


@pytest.fixture(scope="module")
def llm(smollm2_url: str, model_name: str) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=smollm2_url,
        api_key="unused",  # type: ignore[arg-type]
        model=model_name,
        temperature=0,
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]
        max_retries=0,
        timeout=300,
        stream_usage=True,
    )


def weather_tool() -> Any:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Weather in a city"""
        return WEATHER_RESULT

    return get_weather


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_required_and_named_tool_calls(llm: Any, choice: str) -> None:
    ai = llm.bind_tools([weather_tool()], tool_choice=choice).invoke("What is the weather in Paris?")
    assert ai.tool_calls, ai
    for call in ai.tool_calls:
        assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str), call
        assert call["id"].startswith("call_")
    assert ai.response_metadata["finish_reason"] == "tool_calls"


def test_structured_output(llm: Any) -> None:
    got = llm.with_structured_output(Weather, method="json_schema").invoke("Weather in Paris?")
    assert isinstance(got, Weather) and got.city


def test_streamed_usage(llm: Any) -> None:
    whole = None
    chunks = 0
    for chunk in llm.stream("What is the capital of France?"):
        whole = chunk if whole is None else whole + chunk
        chunks += 1
    assert whole is not None and chunks > 2 and "Paris" in whole.content
    usage = whole.usage_metadata
    assert usage is not None and usage["input_tokens"] > 0
    assert 0 < usage["output_tokens"] <= MAX_TOKENS
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_round_trip_with_auto(llm: Any) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    tool = weather_tool()
    bound = llm.bind_tools([tool])  # tool_choice auto
    messages: list[Any] = [HumanMessage(CALL_PROMPT)]
    ai = bound.invoke(messages)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
    messages += [ai, ToolMessage(tool.invoke(call["args"]), tool_call_id=call["id"])]
    answer = bound.invoke(messages)
    assert not answer.tool_calls and WEATHER_RESULT in answer.content, answer
