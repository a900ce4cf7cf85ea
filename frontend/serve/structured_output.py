"""Which grammar a request asks for: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) and its older ``guided_json`` / ``guided_regex`` / ``guided_choice``, turned into a
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


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (its StructuredOutputsParams): exactly one constraint."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF), as xgrammar reads it
    json_object: bool | None = None
    # Options of vLLM's backends. JSON is always generated compactly (no free whitespace) and an
    # object's properties are only the schema's unless it allows more (xgrammar's strict mode),
    # whatever these say; pagedkv has one backend, so there is nothing to fall back to.
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: None = None
    structural_tag: None = None


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
    structured_outputs: StructuredOutputs | None = None,
) -> Grammar | None:
    """The request's grammar, compiled with ``compiler`` (a GrammarCompiler, or None when the server
    has no tokenizer); None when it asks for none."""
    if structured_outputs is not None:
        so = structured_outputs
        given: dict[str, Any] = {
            f"structured_outputs.{k}": v
            for k, v in (
                ("json", so.json_),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
                ("json_object", so.json_object or None),
            )
            if v is not None
        }
        if len(given) > 1:
            names = sorted(given)
            raise StructuredOutputError(names[1], f"only one of {', '.join(names)} per request")
        if not given:
            raise StructuredOutputError(
                "structured_outputs", "give one of json, regex, choice, grammar, json_object"
            )
        ((name, value),) = given.items()
        other = {
            "response_format": response_format
            if response_format and response_format.type != "text"
            else None,
            "guided_json": guided_json,
            "guided_regex": guided_regex,
            "guided_choice": guided_choice,
        }
        clash = next((n for n, v in other.items() if v is not None), None)
        if clash is not None:
            raise StructuredOutputError(clash, f"only one of structured_outputs, {clash} per request")
        if compiler is None:
            raise StructuredOutputError(
                name, "structured output needs a tokenizer, and this server has none (start it with --model)"
            )
        kind = name.split(".", 1)[1]
        if kind == "json_object":
            return compiler.json_object()
        if kind == "grammar":
            try:
                return compiler.ebnf(value)
            except GrammarError as e:
                raise StructuredOutputError(name, f"does not compile: {e}") from None
        try:
            return requested_grammar(
                compiler,
                None,
                value if kind == "json" else None,
                value if kind == "regex" else None,
                value if kind == "choice" else None,
            )
        except StructuredOutputError as e:
            raise StructuredOutputError(name, str(e).split(": ", 1)[1]) from None
    asked: dict[str, Any] = {
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
            schema_given = value.json_schema.schema_
            return compiler.json_object() if schema_given is None else compiler.json_schema(schema_given)
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
