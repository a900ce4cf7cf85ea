"""Which grammar a request asks for: OpenAI's ``response_format`` (``json_object``,
``json_schema``) and vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice``, turned into a
compiled grammar (frontend/serve/grammar.py) that every sample of the request follows. At most one of
them per request; each needs the server's tokenizer (the grammar is matched against its
vocabulary). A ``json_schema`` is enforced whether ``strict`` is set or not.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedkv.frontend.serve.grammar import Grammar, GrammarError


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputError(ValueError):
    """A 400: ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def requested_grammar(
    compiler: Any,
    response_format: ResponseFormat | None,
    guided_json: dict[str, Any] | str | None,
    guided_regex: str | None,
    guided_choice: list[str] | None,
) -> Grammar | None:
    """The request's grammar, compiled with ``compiler`` (a GrammarCompiler, or None when the server
    has no tokenizer); None when it asks for none."""
    asked = {
        name: value
        for name, value in (
            (
                "response_format",
                response_format if response_format and response_format.type != "text" else None,
            ),
            ("guided_json", guided_json),
            ("guided_regex", guided_regex),
            ("guided_choice", guided_choice),
        )
        if value is not None
    }
    if not asked:
        return None
    if len(asked) > 1:
        names = sorted(asked)
        raise StructuredOutputError(names[1], f"only one of {', '.join(names)} per request")
    ((param, value),) = asked.items()
    if compiler is None:
        raise StructuredOutputError(
            param, "structured output needs a tokenizer, and this server has none (start it with --model)"
        )
    try:
        if param == "response_format":
            assert isinstance(value, ResponseFormat)
            if value.type == "json_object":
                return compiler.json_object()
            if value.json_schema is None:
                raise StructuredOutputError("response_format.json_schema", "required with type json_schema")
            given = value.json_schema.schema_
            return compiler.json_object() if given is None else compiler.json_schema(given)
        if param == "guided_json":
            import json

            schema: Any = value
            if isinstance(value, str):
                try:
                    schema = json.loads(value)
                except ValueError as e:
                    raise StructuredOutputError(param, f"not a JSON schema: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputError(param, "a JSON schema is an object")
            return compiler.json_schema(schema)
        if param == "guided_regex":
            return compiler.regex(value)
        if not value or any(not isinstance(c, str) or not c for c in value):
            raise StructuredOutputError(param, "a non-empty list of non-empty strings")
        return compiler.choice(list(value))
    except GrammarError as e:
        where = "response_format.json_schema.schema" if param == "response_format" else param
        raise StructuredOutputError(where, f"does not compile: {e}") from None
