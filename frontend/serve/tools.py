"""OpenAI tool calling for chat requests: ``tools``, ``tool_choice``, ``parallel_tool_calls``, and
the tool turns of a conversation (an assistant's ``tool_calls``, ``tool`` results).

- The tools are validated here (a function name OpenAI would accept, ``parameters`` a JSON schema of
  an object, no name twice) and given to the chat template, which renders them where it supports
  tools (its source mentions ``tools``), as transformers does when its chat templating is given ``tools``.
- ``auto``: the model decides; its answer is read for calls in its family's syntax
  (frontend/serve/tool_parsers.py, the family from ``--tool-call-parser`` or the template). A
  template that renders no tools gets the functions described in a system message (as for
  ``required``) and a grammar that lets the answer be either a call of one of them, its arguments
  valid against that function's ``parameters`` (or, with parallel calls, a JSON array of such
  calls), or plain text that does not start like one (not ``{`` or ``[``, nor whitespace); the
  ``json`` family reads it, the text as content (llama.cpp's generic tool format does the same for
  templates it knows nothing about).
- ``required`` and a named function: the answer is forced by a grammar (frontend/serve/grammar.py,
  the structured-output machinery) to be ``{"name": ..., "arguments": ...}`` with the arguments valid
  against that function's ``parameters`` (with parallel calls allowed under ``required``: a JSON array
  of one or more such objects). A template that renders no tools gets the functions described in a
  system message instead (``fallback_system_text``), so the model still sees their schemas.
- ``none``: the model answers with content; tools are still rendered where the template can.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedkv.frontend.serve.grammar import Grammar, GrammarCompiler, GrammarError
from pagedkv.frontend.serve.tool_parsers import JSON_OR_TEXT, PARSERS, parser_for_template

AUTO_PARSER = "auto"
TOOL_CALL_PARSERS = (AUTO_PARSER, *PARSERS)


class ToolError(ValueError):
    """A 400: ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


# --- request shapes -------------------------------------------------------------------------------
class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments are enforced where a grammar forces them, strict or not


class ToolDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str
    arguments: str


class ToolCallParam(BaseModel):
    """An earlier call in an assistant message."""

    model_config = ConfigDict(strict=True, extra="forbid")
    id: str
    type: Literal["function"]
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
CHOICES = ("none", "auto", "required")


def tool_choice_of(raw: str | dict[str, Any] | None) -> ToolChoice | None:
    """The request's ``tool_choice`` (a mode, or a named function), checked field by field."""
    if raw is None or (isinstance(raw, str) and raw in CHOICES):
        return raw  # type: ignore[return-value]
    if isinstance(raw, str):
        raise ToolError("tool_choice", f"expected one of {', '.join(map(repr, CHOICES))} or a named function")
    from pydantic import ValidationError

    try:
        return NamedToolChoice.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(["tool_choice", *(str(p) for p in err["loc"])])
        raise ToolError(where, "this field is required" if err["type"] == "missing" else err["msg"]) from None


# --- what a request asks for ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ToolCalling:
    """How one chat response reads tool calls from its samples."""

    parser: str  # frontend/serve/tool_parsers.py name
    max_calls: int | None  # 1 with parallel_tool_calls false (or a named function)
    forced: bool  # required / named: the grammar's answer, never content


@dataclass(slots=True)
class ToolRequest:
    """A validated request's tools: what the template gets, and how the answer is read."""

    template_tools: list[dict[str, Any]] | None  # given to apply_chat_template(tools=...)
    system_text: str | None  # the fallback description, for a template that renders no tools
    calling: ToolCalling | None  # None: the answer is content only (no tools, or tool_choice none)
    grammar: Grammar | None  # required / named


def template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):  # named templates: the default one is what chat renders
        template = template.get("default") or next(iter(template.values()), "")
    return template if isinstance(template, str) else ""


def renders_tools(template: str) -> bool:
    """Whether the chat template shows the model a ``tools`` argument."""
    return "tools" in template


def renders_tool_calls(template: str) -> bool:
    """Whether the chat template renders an assistant message's ``tool_calls``."""
    return "tool_calls" in template


def _check_parameters(i: int, fn: FunctionDef) -> dict[str, Any]:
    param = f"tools.{i}.function.parameters"
    params = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
    if params.get("type", "object") != "object":
        raise ToolError(
            param,
            f"the arguments are a JSON object: the schema's type must be 'object', not {params['type']!r}",
        )
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(params)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ToolError(
            param, f"not a valid JSON schema{f' at {where}' if where else ''}: {e.message}"
        ) from None
    return params


def _call_schema(fn: FunctionDef, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": fn.name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _answer_schema(functions: list[tuple[FunctionDef, dict[str, Any]]], parallel: bool) -> dict[str, Any]:
    calls = [_call_schema(fn, p) for fn, p in functions]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


def fallback_system_text(functions: list[FunctionDef], parallel: bool, auto: bool = False) -> str:
    """What a model whose template renders no tools is told (the grammar enforces the same shape);
    ``auto``: it may answer in text instead."""
    lines = [
        json.dumps(
            {"name": fn.name, "description": fn.description or "", "parameters": fn.parameters or {}},
            ensure_ascii=False,
        )
        for fn in functions
    ]
    # Short: a small model's context (and a CPU's prefill) pays for every token of it.
    several = ", or a JSON array of such objects to call several" if parallel else ""
    otherwise = " Otherwise, answer in plain text." if auto else ""
    return (
        "Functions you can call:\n"
        + "\n".join(lines)
        + f'\nTo call one, answer only {{"name": <function name>, "arguments": <JSON object>}}{several}.'
        + otherwise
    )


# Text that cannot be the start of a call: its first character is none of what a call (or, with
# whitespace first, the json parser) would read as one.
PLAIN_TEXT_EBNF = "root ::= [^{[ \\t\\r\\n] [^]*"


def calls_as_text(calls: list[ToolCallParam], arguments: list[Any]) -> str:
    """An assistant's earlier calls as the text a template without tool support shows (the shape
    ``fallback_system_text`` asks for)."""
    objs = [{"name": c.function.name, "arguments": a} for c, a in zip(calls, arguments, strict=True)]
    return json.dumps(objs[0] if len(objs) == 1 else objs, separators=(", ", ": "))


def tool_request(
    tools: list[ToolDef] | None,
    raw_choice: str | dict[str, Any] | None,
    parallel: bool | None,
    template: str,
    parser_setting: str,
    compiler: GrammarCompiler | None,
) -> ToolRequest:
    """The request's tool calling, checked (ToolError names the bad field)."""
    choice = tool_choice_of(raw_choice)
    if not tools:
        if choice not in (None, "none"):
            raise ToolError("tool_choice", "only allowed with tools")
        return ToolRequest(None, None, None, None)
    checked: list[tuple[FunctionDef, dict[str, Any]]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            raise ToolError(f"tools.{i}.function.name", f"{tool.function.name!r} is given twice")
        seen.add(tool.function.name)
        checked.append((tool.function, _check_parameters(i, tool.function)))
    asked = "tool_choice" if choice is not None else "tools"  # what a refusal of `auto` names
    choice = "auto" if choice is None else choice
    tools_shown = renders_tools(template)
    template_tools = [t.model_dump(exclude_none=True) for t in tools] if tools_shown else None
    if choice == "none":
        return ToolRequest(template_tools, None, None, None)
    if choice == "auto":
        if not tools_shown:
            return _described_auto(tools, checked, parallel is not False, compiler)
        parser = parser_setting if parser_setting != AUTO_PARSER else parser_for_template(template)
        if parser is None:
            raise ToolError(
                asked,
                "tool_choice 'auto' needs to know the model's tool-call syntax, and its chat template "
                "names none pagedkv reads; start the server with --tool-call-parser",
            )
        return ToolRequest(
            template_tools, None, ToolCalling(parser, None if parallel is not False else 1, False), None
        )
    if isinstance(choice, NamedToolChoice):
        wanted = [(fn, p) for fn, p in checked if fn.name == choice.function.name]
        if not wanted:
            raise ToolError(
                "tool_choice.function.name", f"{choice.function.name!r} is not one of the tools' names"
            )
        checked, many = wanted, False
    else:  # required
        many = parallel is not False
    if compiler is None:
        raise ToolError("tool_choice", "enforcing a call needs a tokenizer, and this server has none")
    grammar = _compiled(tools, compiler, lambda: compiler.json_schema(_answer_schema(checked, many)))
    system = None if tools_shown else fallback_system_text([fn for fn, _ in checked], many)
    return ToolRequest(template_tools, system, ToolCalling("json", None if many else 1, True), grammar)


def _compiled(tools: list[ToolDef], compiler: GrammarCompiler, build: Callable[[], Grammar]) -> Grammar:
    """``build()``, a grammar of the tools' calls; a schema that does not compile is a 400 naming it."""
    try:
        return build()
    except GrammarError as e:
        for i, tool in enumerate(tools):  # which function's schema does not compile
            try:
                compiler.json_schema(tool.function.parameters or {"type": "object"})
            except GrammarError as one:
                raise ToolError(f"tools.{i}.function.parameters", f"does not compile: {one}") from None
        raise ToolError("tools", f"does not compile: {e}") from None


def _described_auto(
    tools: list[ToolDef],
    checked: list[tuple[FunctionDef, dict[str, Any]]],
    parallel: bool,
    compiler: GrammarCompiler | None,
) -> ToolRequest:
    """``auto`` for a template that renders no tools: the functions described in a system message,
    the answer a call (or calls) by the grammar, or text that does not start like one."""
    if compiler is None:
        raise ToolError("tool_choice", "tool calls need a tokenizer, and this server has none")
    schema = _answer_schema(checked, parallel=False)
    if parallel:
        schema = {"anyOf": [schema, _answer_schema(checked, parallel=True)]}
    grammar = _compiled(tools, compiler, lambda: compiler.either_ebnf(schema, PLAIN_TEXT_EBNF))
    system = fallback_system_text([fn for fn, _ in checked], parallel, auto=True)
    return ToolRequest(None, system, ToolCalling(JSON_OR_TEXT, None if parallel else 1, False), grammar)
