"""instructor, unmodified, against `pagedkv up` on the packaged SmolLM2 GGUF: a pydantic model through
its tool mode (a named tool call, also streamed as partial objects) and its JSON-schema mode
(response_format json_schema), each validated into the model, with the completion's usage. (Its
JSON mode, response_format json_object with the schema only in the prompt, is not here: any JSON
object is allowed, and the 135M model writes one that does not end within a few tokens.)"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, Field

from tests.clients.conftest import MAX_TOKENS

instructor = pytest.importorskip("instructor")
pytestmark = pytest.mark.timeout(600)


class Weather(BaseModel):
    """Weather in a city"""

    city: str = Field(max_length=24)


@pytest.fixture(scope="module")
def client(smollm2_url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=smollm2_url, api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_a_pydantic_model_comes_back_validated(client: Any, model_name: str, mode: str) -> None:
    ic = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    got, completion = ic.chat.completions.create_with_completion(
        model=model_name,
        response_model=Weather,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,  # a first answer that does not validate fails the test
    )
    assert isinstance(got, Weather) and got.city
    assert 0 < completion.usage.completion_tokens <= MAX_TOKENS
    if mode == "TOOLS":
        assert completion.choices[0].finish_reason == "tool_calls"


def test_streamed_partial_objects(client: Any, model_name: str) -> None:
    ic = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    partials = list(
        ic.chat.completions.create_partial(
            model=model_name,
            response_model=Weather,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            max_retries=0,
        )
    )
    assert len(partials) > 1 and partials[-1].city
