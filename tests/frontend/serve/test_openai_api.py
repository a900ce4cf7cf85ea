"""Request parsing limits (frontend/serve/openai_api.py), without processes: a prompt plus max_tokens
may fill exactly what one sequence can hold (the model's context, or the pool when it holds
less), and not one token more."""

from __future__ import annotations

import pytest

from pagedkv.frontend.serve.openai_api import ApiError, RequestLimits, parse_completion
from pagedkv.frontend.serve.text import ModelText


@pytest.mark.parametrize(
    ("model_len", "blocks", "context"),
    [(64, 64, 64), (0, 16, 64), (1000, 16, 64)],
    ids=["model-context", "pool-no-model-context", "pool-smaller-than-model"],
)
def test_prompt_plus_max_tokens_equal_to_the_context_is_accepted_one_more_is_refused(
    model_len: int, blocks: int, context: int
) -> None:
    limits = RequestLimits("tiny", 128, 4, blocks, ModelText(max_model_len=model_len))
    assert limits.max_context == context
    prompt = [1] * 10
    got = parse_completion({"prompt": prompt, "max_tokens": context - 10}, limits)
    assert got.max_tokens == context - 10
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": prompt, "max_tokens": context - 9}, limits)
    assert e.value.status == 400 and e.value.param == "max_tokens"
    assert f"= {context + 1} exceeds the {context} tokens" in e.value.message
    # Without max_tokens (chat's default) the rest of the context; a prompt that fills it is refused.
    assert parse_completion({"prompt": prompt, "max_tokens": None}, limits).max_tokens == context - 10
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": [1] * context}, limits)
    assert e.value.param == "prompt"
