"""Tool calls read from model text (frontend/serve/tool_parsers.py), whole and streamed: streamed
character by character (and in random pieces), the deltas join to the same content and calls as
the whole text; text that may still become a call is never streamed as content."""

from __future__ import annotations

import json
import random

import pytest

from pagedkv.frontend.serve.tool_parsers import (
    CallDelta,
    ToolCallStream,
    parser_by_name,
    parser_for_template,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'


def whole(parser: str, text: str, max_calls: int | None = None) -> tuple[str, list[tuple[str, str]]]:
    s = ToolCallStream(parser_by_name(parser), max_calls)
    s.feed(text, final=True)
    return s.content, [(c.name, c.arguments) for c in s.calls]


def streamed(
    parser: str, pieces: list[str], max_calls: int | None = None
) -> tuple[str, list[tuple[str, str]], list[str], list[CallDelta]]:
    """Joined content, calls rebuilt from the deltas as a client does, each content delta, all deltas."""
    s = ToolCallStream(parser_by_name(parser), max_calls)
    contents, deltas = [], []
    for i, p in enumerate(pieces):
        content, ds = s.feed(p, final=i == len(pieces) - 1)
        contents.append(content)
        deltas += ds
    calls: list[list[str]] = []
    for d in deltas:
        if d.id is not None:
            assert d.index == len(calls) and d.id.startswith("call_") and d.arguments == ""
            calls.append([d.name or "", ""])
        else:
            calls[d.index][1] += d.arguments
    return "".join(contents), [(n, a) for n, a in calls], contents, deltas


CASES = [
    # (parser, text, content, calls)
    ("hermes", "Sure.", "Sure.", []),
    (
        "hermes",
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        "",
        [("get_weather", '{"city": "Paris", "days": [1, 2]}')],
    ),
    (
        "hermes",
        f"Let me look.<tool_call>{WEATHER}</tool_call>\n"
        '<tool_call>\n{"arguments": {}, "name": "b"}\n</tool_call>',
        "Let me look.",
        [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("b", "{}")],
    ),
    ("hermes", "a <tool_call> b", "a <tool_call> b", []),  # a tag without a call
    ("hermes", '<tool_call>{"x": 1}</tool_call>', '<tool_call>{"x": 1}</tool_call>', []),  # no name
    ("hermes", '<tool_call>{"name": 3}', '<tool_call>{"name": 3}', []),  # a name that is no string
    ("hermes", '<tool_call>{"name": "f"}</tool_call> done', "done", [("f", "{}")]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}', "", [("f", '{"a": 1}')]),
    ("hermes", 'x <tool_call>{"name": "f", "arguments": {"a": "}"', "x ", [("f", '{"a": "}"')]),  # cut
    ("hermes", "1 < 2 <tool_", "1 < 2 <tool_", []),  # a tag that never came
    ("llama3_json", '{"name": "f", "parameters": {"q": "x"}}', "", [("f", '{"q": "x"}')]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"n": 12}}',
        "",
        [("f", "{}"), ("g", '{"n": 12}')],
    ),
    ("llama3_json", "The answer is {1, 2}.", "The answer is {1, 2}.", []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON that is not a call
    ("json", f"[{WEATHER}, {WEATHER}]", "", [("get_weather", '{"city": "Paris", "days": [1, 2]}')] * 2),
    ("json", '{"name": "f", "arguments": {"n": -1.5e3}}', "", [("f", '{"n": -1.5e3}')]),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_text(parser: str, text: str, content: str, calls: list[tuple[str, str]]) -> None:
    assert whole(parser, text) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_in_any_pieces_joins_to_the_whole(
    parser: str, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    got = streamed(parser, list(text))
    assert got[:2] == (content, calls)
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(4, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(parser, pieces)[:2] == (content, calls), pieces


def test_a_call_streams_its_name_first_then_argument_fragments() -> None:
    text = f"<tool_call>{WEATHER}</tool_call>"
    _, _, contents, deltas = streamed("hermes", list(text))
    assert not "".join(contents)  # nothing of the call leaked as content
    first = deltas[0].openai()
    assert first["type"] == "function" and first["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [d.arguments for d in deltas[1:]]
    assert len(fragments) > 5  # the arguments arrive as they are written, not at the end
    assert json.loads("".join(fragments)) == {"city": "Paris", "days": [1, 2]}
    assert deltas[1].openai() == {"index": 0, "function": {"arguments": fragments[0]}}


def test_text_that_may_start_a_call_is_held_back_until_ruled_out() -> None:
    s = ToolCallStream(parser_by_name("hermes"))
    assert s.feed("Hello <tool") == ("Hello ", [])
    assert s.feed("box>") == ("<toolbox>", [])
    assert s.feed(" <tool_call>{") == (" ", [])
    assert s.feed('"nam') == ("", [])
    content, deltas = s.feed('e": "f"')
    assert content == "" and [(d.name, d.arguments) for d in deltas] == [("f", "")]
    llama = ToolCallStream(parser_by_name("llama3_json"))
    assert llama.feed(" ") == ("", [])
    assert llama.feed("{") == ("", [])
    assert llama.feed('"a": 1}') == (' {"a": 1}', [])


def test_max_calls_keeps_the_first() -> None:
    text = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    assert whole("hermes", text, max_calls=1) == ("", [("a", "{}")])


def test_the_family_is_read_from_the_chat_template() -> None:
    qwen = '{%- if tools %}<tool_call>\\n{"name": <function-name>, "arguments": <args>}\\n</tool_call>'
    llama = '{{- \'{"name": function name, "parameters": dictionary of argument name and its value}\' }}'
    assert parser_for_template(qwen) == "hermes"
    assert parser_for_template(llama + "<|python_tag|>") == "llama3_json"
    assert parser_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parser_by_name("mistral")
