"""Tool calls in a model's output text, per model family, streamed or not.

A parser is a pure function of the text so far: ``parse(text, final)`` says which part of it is
content (released: it never changes once said) and which tool calls it holds (a call appears once
its name is read; its arguments, the raw JSON text the model wrote, only grow). Whatever may still
turn out to be a tool call (the start of a ``<tool_call>`` tag, a call whose name has not arrived)
is neither yet: it is held back. ``ToolCallStream`` turns successive parses into OpenAI's deltas;
the non-streamed answer is the same stream fed the whole text at once, so the joined deltas of a
stream are the non-streamed answer by construction.

Parsers, chosen by name (``--tool-call-parser``; ``auto`` reads the chat template):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the text
  (Hermes, Qwen2/2.5/3 templates); the text around the calls is content.
- ``llama3_json``: Llama 3.1+'s JSON tool calls, ``{"name": ..., "parameters": {...}}`` as the
  whole answer (after an optional ``<|python_tag|>``), several separated by ``;``. An answer that
  does not start with such an object is content.
- ``json``: the answer pagedkv's own grammar enforces for ``tool_choice`` ``required`` or a named
  function (frontend/serve/tools.py): one call object, or an array of them. Never content.

And, not for ``--tool-call-parser`` (pagedkv's own grammar writes it): ``json_or_text``, ``json``'s
calls or, for an answer that does not start like them, content (``auto`` where the template
renders no tools).

A call object is read leniently: keys in any order, ``arguments`` or ``parameters`` for the
arguments (a JSON object, or a string holding one), other keys skipped. An object that ends
without a string ``name`` is not a call (its text stays content); once a call's name is read the
call stands, and text that breaks the object after that is dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Protocol

ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\r\n"


@dataclass(slots=True)
class CallDraft:
    """One tool call as read so far."""

    name: str
    arguments: str  # the arguments' JSON text so far ("{}" for a call that has none)
    complete: bool


@dataclass(slots=True)
class ToolParse:
    content: str  # text released as content
    calls: list[CallDraft] = field(default_factory=list)


class ToolCallParser(Protocol):
    name: str

    def parse(self, text: str, final: bool) -> ToolParse: ...


# --- reading one call object ----------------------------------------------------------------------
@dataclass(slots=True)
class _Object:
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None  # index after the arguments' value, once it is complete
    end: int | None = None  # index after the closing brace, once it came
    broken: bool = False  # text that is not a JSON object came before its end


def _loads(text: str) -> object:
    """A JSON string's value; None for one that does not decode (a bad escape)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> int | None:
    """Index after the string starting at ``pos`` (a quote), or None if it has not ended yet."""
    i = pos + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _value_end(text: str, pos: int) -> int | None:
    """Index after the JSON value starting at ``pos``, or None if it may not have ended yet."""
    c = text[pos]
    if c == '"':
        return _string_end(text, pos)
    if c in "{[":
        depth, i = 0, pos
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    i = pos
    while i < len(text) and text[i] not in ",}]" + _WS:
        i += 1
    return i if i < len(text) else None  # a number or literal ends only at what follows it


def _read_object(text: str, start: int) -> _Object:
    """The call object whose ``{`` is at ``start``, as far as ``text`` goes."""
    out = _Object()
    pos = start + 1
    while True:
        pos = _skip_ws(text, pos)
        if pos >= len(text):
            return out
        c = text[pos]
        if c == "}":
            out.end = pos + 1
            return out
        if c == ",":
            pos += 1
            continue
        if c != '"':
            out.broken = True
            return out
        key_end = _string_end(text, pos)
        if key_end is None:
            return out
        key = _loads(text[pos:key_end])
        if not isinstance(key, str):
            out.broken = True
            return out
        pos = _skip_ws(text, key_end)
        if pos >= len(text):
            return out
        if text[pos] != ":":
            out.broken = True
            return out
        pos = _skip_ws(text, pos + 1)
        if pos >= len(text):
            return out
        end = _value_end(text, pos)
        if key == "name" and out.name is None:
            if end is None:
                return out
            name = _loads(text[pos:end]) if text[pos] == '"' else None
            if not isinstance(name, str):
                out.broken = True
                return out
            out.name = name
        elif key in ARGUMENT_KEYS and out.args_start is None:
            out.args_start, out.args_end = pos, end
        if end is None:
            return out
        pos = end


def _draft(text: str, obj: _Object) -> CallDraft:
    """The call ``obj`` holds (its name is known)."""
    assert obj.name is not None
    complete = obj.end is not None or obj.broken
    if obj.args_start is None:
        args = "{}" if complete else ""
    elif obj.args_end is None:
        # Still being written: what has come, unless it is a string (decoded once whole).
        args = "" if text[obj.args_start : obj.args_start + 1] == '"' else text[obj.args_start :]
    else:
        args = text[obj.args_start : obj.args_end]
        if args.startswith('"'):
            decoded = _loads(args)
            args = decoded if isinstance(decoded, str) else args
    return CallDraft(obj.name, args, complete)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest ending of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


# --- the families ---------------------------------------------------------------------------------
class HermesParser:
    """``<tool_call>{...}</tool_call>`` blocks anywhere; the text around them is content."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> ToolParse:
        out = ToolParse("")
        pos = 0
        while True:
            at = text.find(self.START, pos)
            if at < 0:
                tail = text[pos:]
                out.content += tail if final else tail[: len(tail) - _held_prefix(tail, self.START)]
                return out
            out.content += text[pos:at]
            body = _skip_ws(text, at + len(self.START))
            if body >= len(text):  # the tag, nothing after it yet
                if final:
                    out.content += text[at:]
                return out
            if text[body] != "{":  # a tag without a call: plain text
                out.content += text[at:body]
                pos = body
                continue
            obj = _read_object(text, body)
            if obj.name is None:
                if (obj.end is None and not obj.broken) and not final:
                    return out  # its name may still come
                out.content += text[at:body]  # not a call: the tag is text, the rest is read again
                pos = body
                continue
            out.calls.append(_draft(text, obj))
            if obj.end is None and not obj.broken:
                return out
            pos = self._after_call(text, obj, final)
            if pos < 0:
                return out

    def _after_call(self, text: str, obj: _Object, final: bool) -> int:
        """Where content resumes after a call: past its closing tag (and the whitespace around it);
        -1 while what follows may still be the closing tag."""
        if obj.broken:  # drop the rest of the block
            close = text.find(self.END, obj.args_end or 0)
            if close < 0:
                return len(text) if final else -1
            return _skip_ws(text, close + len(self.END))
        assert obj.end is not None
        pos = _skip_ws(text, obj.end)
        if text.startswith(self.END, pos):
            return _skip_ws(text, pos + len(self.END))
        if not final and self.END.startswith(text[pos:]):
            return -1
        return pos


class CallListParser:
    """Calls as the whole answer: JSON call objects, in an array (``json``) or separated by
    ``;`` (``llama3_json``, after an optional ``<|python_tag|>``)."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, name: str, separator: str, content_allowed: bool) -> None:
        self.name = name
        self._sep = separator
        self._content_allowed = content_allowed  # else nothing is ever content (the grammar's answer)

    def parse(self, text: str, final: bool) -> ToolParse:
        out = ToolParse("")
        pos = _skip_ws(text, 0)
        if text.startswith(self.PYTHON_TAG, pos):
            pos = _skip_ws(text, pos + len(self.PYTHON_TAG))
        elif self.PYTHON_TAG.startswith(text[pos:]) and not final:
            return out  # may still be the tag (or nothing yet)
        in_array = pos < len(text) and text[pos] == "[" and self._sep == ","
        if in_array:
            pos = _skip_ws(text, pos + 1)
        while True:
            if pos >= len(text):  # nothing yet where a call may begin
                return self._rest(out, text, pos, final) if final else out
            if text[pos] != "{":
                return self._rest(out, text, pos, final)
            obj = _read_object(text, pos)
            if obj.name is None:
                if obj.end is None and not obj.broken and not final:
                    return out
                return self._rest(out, text, pos, final)
            out.calls.append(_draft(text, obj))
            if obj.end is None:
                return out
            after = _skip_ws(text, obj.end)
            if after < len(text) and text[after] == self._sep:
                pos = _skip_ws(text, after + 1)
                continue
            if in_array and after < len(text) and text[after] == "]":
                after = _skip_ws(text, after + 1)
            return self._rest(out, text, after, final)

    def _rest(self, out: ToolParse, text: str, pos: int, final: bool) -> ToolParse:
        """Text from ``pos`` that is not a call: content (all of it when there is no call at all),
        once it cannot be the start of another call."""
        if not self._content_allowed:
            return out
        out.content = text if not out.calls else text[pos:]
        return out


PARSERS = ("hermes", "llama3_json", "json")
JSON_OR_TEXT = "json_or_text"


def parser_by_name(name: str) -> ToolCallParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return CallListParser("llama3_json", ";", content_allowed=True)
    if name == "json":
        return CallListParser("json", ",", content_allowed=False)
    if name == JSON_OR_TEXT:
        return CallListParser(JSON_OR_TEXT, ",", content_allowed=True)
    raise ValueError(f"unknown tool-call parser {name!r} (known: {', '.join(PARSERS)})")


def parser_for_template(template: str) -> str | None:
    """The family a chat template's tool calls belong to: what the template tells the model to
    write (or writes itself for earlier calls). None when it says nothing pagedkv knows."""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name' in template:
        return "llama3_json"
    return None


# --- the stream of deltas ---------------------------------------------------------------------------
@dataclass(slots=True)
class CallDelta:
    """One piece of a streamed call: its first carries the id and the name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, object]:
        out: dict[str, object] = {"index": self.index}
        fn: dict[str, object] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
            fn = {"name": self.name, "arguments": self.arguments}
        out["function"] = fn
        return out


@dataclass(slots=True)
class StreamedCall:
    id: str
    name: str
    arguments: str = ""

    def openai(self) -> dict[str, object]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallStream:
    """One sample's text turned into content and tool-call deltas as it arrives; ``max_calls``
    keeps the first calls only (``parallel_tool_calls: false``)."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None) -> None:
        self._parser = parser
        self._max = max_calls
        self._text = ""
        self.content = ""  # content released so far
        self.calls: list[StreamedCall] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """``text`` (what came since the last feed); the new content and call deltas."""
        self._text += text
        got = self._parser.parse(self._text, final)
        assert got.content.startswith(self.content), "a parser took back released content"
        new_content = got.content[len(self.content) :]
        self.content = got.content
        deltas = []
        for i, draft in enumerate(got.calls[: self._max]):
            if i == len(self.calls):
                self.calls.append(StreamedCall(call_id(), draft.name))
                deltas.append(CallDelta(i, "", self.calls[i].id, draft.name))
            call = self.calls[i]
            if len(draft.arguments) > len(call.arguments):
                assert draft.arguments.startswith(call.arguments), "a parser took back arguments"
                deltas.append(CallDelta(i, draft.arguments[len(call.arguments) :]))
                call.arguments = draft.arguments
        return new_content, deltas
