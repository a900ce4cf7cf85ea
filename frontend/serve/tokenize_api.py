"""`/tokenize` and `/detokenize` in vLLM's shapes: what a client needs to count tokens against
``max_model_len`` or to see how the server splits a prompt, with the server's own tokenizer and
chat template (docs/serve.md).

    POST /tokenize    {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
                   or {"messages": [...], "add_generation_prompt": true, "return_token_strs": false}
                   -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [int]} -> {"prompt": str}

Fields are checked as strictly as the completion routes' (unknown ones are 400).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedkv.frontend.serve.openai_api import (
    ApiError,
    ChatMessage,
    RequestLimits,
    chat_prompt,
    check_model,
    validation_error,
)


class TokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # prompt: default true; messages: the template places them
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[int]


def _body(raw: Any, model: type[BaseModel], limits: RequestLimits) -> tuple[Any, Any]:
    """The validated body and the tokenizer."""
    if not isinstance(raw, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        body = model.model_validate(raw)
    except ValidationError as e:
        raise validation_error(e) from None
    check_model(body.model, limits)  # type: ignore[attr-defined]
    tokenizer = limits.text.tokenizer
    if tokenizer is None:
        raise ApiError(
            400, "this server has no tokenizer (start it with --model DIR for a model with one)", None
        )
    return body, tokenizer


def tokenize(raw: Any, limits: RequestLimits) -> dict[str, Any]:
    body, tokenizer = _body(raw, TokenizeBody, limits)
    assert isinstance(body, TokenizeBody)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "prompt: send either prompt or messages", "prompt")
    if body.messages is not None:
        if body.add_special_tokens:
            raise ApiError(
                400,
                "add_special_tokens: with messages the chat template places the special tokens",
                "add_special_tokens",
            )
        ids = chat_prompt(body.messages, limits, body.add_generation_prompt)
    else:
        assert body.prompt is not None
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = [int(t) for t in tokenizer.encode(body.prompt, add_special_tokens=add)]
    return {
        "count": len(ids),
        "max_model_len": limits.max_model_len,
        "tokens": ids,
        "token_strs": [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
        if body.return_token_strs
        else None,
    }


def detokenize(raw: Any, limits: RequestLimits) -> dict[str, Any]:
    body, tokenizer = _body(raw, DetokenizeBody, limits)
    assert isinstance(body, DetokenizeBody)
    bad = next((t for t in body.tokens if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"tokens: token id {bad} is out of range [0, {limits.vocab_size})", "tokens")
    return {"prompt": str(tokenizer.decode(body.tokens))}
