"""Tool calling in chat requests (frontend/serve/tools.py, openai_api.py), no processes: tools and
tool_choice are checked naming the bad field; the template renders the tools where it can, and a
template that cannot gets them as a system message (SmolLM2's, the packaged model's); an
assistant's calls and tool results reach the template; the grammar that ``required`` and a named
function impose lets exactly the valid calls through, token by token, on SmolLM2's vocabulary."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from pagedkv.frontend.serve.grammar import Matcher
from pagedkv.frontend.serve.openai_api import ApiError, RequestLimits, parse_chat
from pagedkv.frontend.serve.text import load_model_text
from pagedkv.frontend.serve.tools import ToolCalling

pytest.importorskip("xgrammar")
EOS = 2  # <|im_end|>
CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather", "parameters": CITY},
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def fn(name: str, parameters: Any = None) -> dict[str, Any]:
    f = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": f}


def called(role: str, arguments: str) -> dict[str, Any]:
    """A message of ``role`` carrying one earlier call of get_weather."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {"role": role, "content": None, "tool_calls": [call]}


HISTORY = [
    *USER,
    called("assistant", '{"city": "Paris"}'),
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
]
NAMED_NOW = {"type": "function", "function": {"name": "now"}}
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
ONE_NOW = '{"name": "now", "arguments": {}}'
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
# A template that renders tools and earlier calls the way Qwen's and Hermes' do (JSON in <tool_call>).
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    'Call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def smol(smollm2_tokenizer_dir: pathlib.Path) -> RequestLimits:
    return RequestLimits("smol", 49152, 16, 256, load_model_text(str(smollm2_tokenizer_dir)))


@pytest.fixture(scope="module")
def hermes(smollm2_tokenizer_dir: pathlib.Path) -> RequestLimits:
    text = load_model_text(str(smollm2_tokenizer_dir))
    text.tokenizer.chat_template = HERMES_TEMPLATE
    return RequestLimits("smol", 49152, 16, 256, text)


def prompt_text(limits: RequestLimits, body: dict[str, Any]) -> str:
    parsed = parse_chat({"messages": USER, **body}, limits)
    return str(limits.text.tokenizer.decode(parsed.prompts[0]))


def refused(limits: RequestLimits, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": USER, **body}, limits)
    assert e.value.status == 400 and e.value.message.startswith(f"{e.value.param}: ")
    return e.value


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type", "function"),
        ({"tools": [fn("no spaces")]}, "tools.0.function.name", "pattern"),
        ({"tools": [fn("f", {"type": "string"})]}, "tools.0.function.parameters", "must be 'object'"),
        ({"tools": [fn("f", {"properties": {"a": {"type": "nope"}}})]},
         "tools.0.function.parameters", "not a valid JSON schema at properties/a/type"),
        ({"tools": [WEATHER, NOW, WEATHER]}, "tools.2.function.name", "given twice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "expected one of"),
        ({"tools": [WEATHER], "tool_choice": NAMED_NOW}, "tool_choice.function.name", "'now' is not one of"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}},
         "tool_choice.function.name", "required"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed with tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_json": CITY}, "guided_json", "forces"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", ""),
        ({"messages": [called("user", "{}")]}, "messages.0.tool_calls", "only assistant messages"),
        ({"messages": [called("assistant", "{oops")]},
         "messages.0.tool_calls.0.function.arguments", "not JSON"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_refused_naming_them(
    hermes: RequestLimits, body: dict[str, Any], param: str, words: str
) -> None:
    e = refused(hermes, body)
    assert e.param == param and words in e.message, e.message


def test_auto_on_a_template_without_tools_describes_them_and_constrains_the_answer(
    smol: RequestLimits,
) -> None:
    """SmolLM2's template renders no tools: ``auto`` (the default with tools) tells the model about
    them in a system message, lets it answer in text, and reads its answer with json_or_text."""
    assert parse_chat({"messages": USER, "tools": [WEATHER, NOW]}, smol).tools == ToolCalling(
        "json_or_text", None, False
    )
    p = parse_chat({"messages": USER, "tools": [WEATHER], "parallel_tool_calls": False}, smol)
    assert p.tools == ToolCalling("json_or_text", 1, False) and p.sampling.grammar is not None
    text = prompt_text(smol, {"tools": [WEATHER, NOW], "tool_choice": "auto"})
    assert text.startswith("<|im_start|>system\nFunctions you can call:\n")
    assert json.dumps(CITY) in text and '"name": "now"' in text
    assert "Otherwise, answer in plain text." in text
    assert "plain text" not in prompt_text(smol, {"tools": [WEATHER], "tool_choice": "required"})
    e = refused(smol, {"tools": [WEATHER], "response_format": {"type": "json_object"}})
    assert e.param == "response_format" and "renders no tools" in e.message


def test_auto_on_a_template_with_tools_needs_its_call_syntax(hermes: RequestLimits) -> None:
    unknown = RequestLimits("smol", 49152, 16, 256, hermes.text)
    unknown.text = load_model_text(str(pathlib.Path(hermes.text.tokenizer.name_or_path)))
    unknown.text.tokenizer.chat_template = HERMES_TEMPLATE.replace("<tool_call>", "[CALL]")
    e = refused(unknown, {"tools": [WEATHER]})
    assert e.param == "tools" and "--tool-call-parser" in e.message
    assert refused(unknown, {"tools": [WEATHER], "tool_choice": "auto"}).param == "tool_choice"
    unknown.tool_call_parser = "hermes"
    assert parse_chat({"messages": USER, "tools": [WEATHER]}, unknown).tools == ToolCalling(
        "hermes", None, False
    )


def test_a_template_that_renders_tools_gets_them_and_the_calls(hermes: RequestLimits) -> None:
    p = parse_chat({"messages": USER, "tools": [WEATHER, NOW], "parallel_tool_calls": False}, hermes)
    assert p.tools == ToolCalling("hermes", 1, False) and p.sampling.grammar is None  # auto: unconstrained
    text = prompt_text(hermes, {"tools": [WEATHER]})
    assert json.dumps(WEATHER["function"]["parameters"]) in text.replace("\n", "")
    text = prompt_text(hermes, {"messages": HISTORY, "tools": [WEATHER], "tool_choice": "none"})
    # The arguments reach the template as an object (it serializes them itself), the result as a tool turn.
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\n22 C<|im_end|>" in text
    none = parse_chat({"messages": USER, "tools": [WEATHER], "tool_choice": "none"}, hermes)
    assert none.tools is None and none.sampling.grammar is None


def test_a_template_without_tools_gets_a_system_message_describing_them(smol: RequestLimits) -> None:
    """SmolLM2's template (ChatML, no tools): required/named describe the functions in a system
    message, which replaces the template's default one (or follows a system message given)."""
    plain = prompt_text(smol, {})
    assert "You are a helpful AI assistant named SmolLM" in plain and "get_weather" not in plain
    text = prompt_text(smol, {"tools": [WEATHER, NOW], "tool_choice": "required"})
    assert text.startswith("<|im_start|>system\nFunctions you can call:\n")
    assert json.dumps(CITY) in text and '"name": "now"' in text and "JSON array" in text
    named = prompt_text(
        smol, {"tools": [WEATHER, NOW], "tool_choice": {"type": "function", "function": {"name": "now"}}}
    )
    assert '"name": "now"' in named and "get_weather" not in named and "JSON array" not in named
    given = prompt_text(
        smol,
        {
            "messages": [{"role": "system", "content": "Be brief."}, *USER],
            "tools": [NOW],
            "tool_choice": "required",
        },
    )
    assert given.startswith("<|im_start|>system\nBe brief.\n\nFunctions you can call:")
    text = prompt_text(smol, {"messages": HISTORY})
    assert '<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Paris"}}<|im_end|>' in text


def test_a_template_without_tools_gets_tool_results_as_a_user_turn(smol: RequestLimits) -> None:
    """No tool turns in the template (its roles could be only user and assistant): a result is a user
    turn saying what the function returned; the results of calls made together share one."""
    text = prompt_text(smol, {"messages": HISTORY, "tools": [WEATHER]})
    assert text.endswith(
        '<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Paris"}}<|im_end|>\n'
        "<|im_start|>user\nThe function returned: 22 C. Answer my question in words.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert "<|im_start|>tool" not in text
    two = [*HISTORY, {"role": "tool", "tool_call_id": "call_2", "content": "Sunny!"}]
    text = prompt_text(smol, {"messages": [*two, {"role": "user", "content": "Thanks"}]})
    assert (
        "<|im_start|>user\nThe function returned: 22 C. The function returned: Sunny! "
        "Answer my question in words.<|im_end|>\n<|im_start|>user\nThanks<|im_end|>"
    ) in text


def allowed(m: Matcher) -> set[int]:
    return {i * 8 + b for i, byte in enumerate(m.mask()) for b in range(8) if byte >> b & 1}


def walks(limits: RequestLimits, body: dict[str, Any], answer: str, more: bool = False) -> bool:
    """Whether the request's grammar lets ``answer`` through, token by token, then only the end
    (``more``: then the end among other tokens, as after text)."""
    grammar = parse_chat({"messages": USER, **body}, limits).sampling.grammar
    m = grammar.matcher()
    for t in limits.text.tokenizer.encode(answer, add_special_tokens=False):
        if t not in allowed(m):
            return False
        assert m.accept(t)
    return EOS in allowed(m) and len(allowed(m)) > 1 if more else allowed(m) == {EOS}


@pytest.mark.parametrize(
    ("body", "ok", "bad"),
    [
        (
            {"tools": [WEATHER, NOW], "tool_choice": "required", "parallel_tool_calls": False},
            ['{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3}}', ONE_NOW],
            [
                '{"name": "get_weather", "arguments": {"city": "Rome"}}',  # not in the enum
                '{"name": "get_weather", "arguments": {"days": 3}}',  # a required argument missing
                '{"name": "get_weather", "arguments": {"city": "Paris", "days": 8}}',  # above the maximum
                '{"name": "weather", "arguments": {}}',  # no such function
                '[{"name": "now", "arguments": {}}]',  # one call only
                "Sure, let me check.",
            ],
        ),
        (
            {"tools": [WEATHER, NOW], "tool_choice": "required"},
            [f"[{ONE_NOW}]", f"[{ONE_NOW}, {PARIS}]"],
            ["[]", ONE_NOW],
        ),
        (
            {"tools": [WEATHER, NOW], "tool_choice": NAMED_WEATHER},
            [PARIS],
            [ONE_NOW, f"[{PARIS}]"],
        ),
    ],
    ids=["required-one", "required-parallel", "named"],
)  # fmt: skip
def test_forced_calls_follow_the_functions_schemas(
    smol: RequestLimits, body: dict[str, Any], ok: list[str], bad: list[str]
) -> None:
    p = parse_chat({"messages": USER, **body}, smol)
    assert p.tools is not None and p.tools.forced and p.tools.parser == "json"
    for answer in ok:
        assert walks(smol, body, answer), answer
    for answer in bad:
        assert not walks(smol, body, answer), answer


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_without_template_tools_lets_through_calls_or_text_that_cannot_be_one(
    smol: RequestLimits, parallel: bool
) -> None:
    """The grammar of ``auto`` where the template renders no tools: a valid call (an array of them
    with parallel calls), or text whose first character starts no call (not ``{``, ``[``, space)."""
    body = {"tools": [WEATHER, NOW], "parallel_tool_calls": parallel}
    ok = [PARIS, ONE_NOW]
    text = ["It is sunny in Paris.", "Sure: {a} [b]", '"Quoted", said the model.', "42"]
    bad = [
        '{"name": "weather", "arguments": {}}',  # no such function
        '{"name": "get_weather", "arguments": {"city": "Rome"}}',  # not in the enum
        '{"name": "get_weather", "arguments": {}}',  # a required argument missing
        "{I think it is sunny}",  # text that starts like a call
        "[1, 2]",
        " It is sunny.",  # space first: would be read past to a call
        "\n" + PARIS,
        "",  # an answer is never empty
    ]
    many = [f"[{ONE_NOW}, {PARIS}]", f"[{ONE_NOW}]"]
    for answer in ok + (many if parallel else []):
        assert walks(smol, body, answer), answer
    for answer in text:
        assert walks(smol, body, answer, more=True), answer
    for answer in bad + ([] if parallel else many):
        assert not walks(smol, body, answer), answer


# --- the server's answers (frontend/serve/server.py), fed tokens as the engine would give them ---
def answer(limits: RequestLimits, body: dict[str, Any], text: str, stream: bool) -> Any:
    """The response (or the chunks) of a chat request whose sample writes ``text`` then ends."""
    import asyncio

    from pagedkv.frontend.engine import TokenEvent
    from pagedkv.frontend.serve.server import ServerState, _Run

    async def run() -> Any:
        parsed = parse_chat({"messages": USER, **body}, limits)
        state = ServerState(None, limits, None, 0, 1, None)  # type: ignore[arg-type]
        r = _Run(state, parsed, "chat")
        ids = [*limits.text.tokenizer.encode(text, add_special_tokens=False), EOS]
        chunks = []
        for k, t in enumerate(ids):
            c = r.on_token(0, TokenEvent(r.request_ids[0], 0, t, 0.0, "stop" if k == len(ids) - 1 else None))
            assert c is not None
            if stream:
                chunks.append(r.chunk(c, [t], [0.0], first=k == 0)["choices"][0])
        return chunks if stream else r.response()["choices"][0]

    return asyncio.run(run())


def joined(chunks: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """Content, calls and finish reason, put together from the deltas as a client does."""
    content, calls = None, []
    for ch in chunks:
        delta = ch["delta"]
        if delta["content"] is not None:
            content = (content or "") + delta["content"]
        for d in delta.get("tool_calls", []):
            if "id" in d:
                assert (
                    d["index"] == len(calls) and d["type"] == "function" and d["function"]["arguments"] == ""
                )
                calls.append({"id": d["id"], "type": "function", "function": dict(d["function"])})
            else:
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return content, calls, chunks[-1]["finish_reason"]


PARIS_ARGS = '{"city": "Paris"}'
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("parser", "body", "text", "content", "calls"),
    [
        ("hermes", {}, "It is sunny.", "It is sunny.", []),
        ("hermes", {}, f"Let me check.\n{CALL_TEXT}", "Let me check.\n", [("get_weather", PARIS_ARGS)]),
        ("hermes", {"parallel_tool_calls": False}, CALL_TEXT + CALL_TEXT.replace("Paris", "Tokyo"), None,
         [("get_weather", PARIS_ARGS)]),
        ("llama3_json", {}, '{"name": "now", "parameters": {}}', None, [("now", "{}")]),
        ("llama3_json", {}, "{1, 2} are numbers", "{1, 2} are numbers", []),
    ],
)  # fmt: skip
def test_auto_answers_streamed_and_not_carry_the_same_calls(
    hermes: RequestLimits,
    parser: str,
    body: dict[str, Any],
    text: str,
    content: str | None,
    calls: list[tuple[str, str]],
) -> None:
    limits = RequestLimits("smol", 49152, 16, 256, hermes.text, tool_call_parser=parser)
    body = {"tools": [WEATHER, NOW], **body}
    whole = answer(limits, body, text, stream=False)
    message = whole["message"]
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert (message["content"], got) == (content, calls)
    assert whole["finish_reason"] == ("tool_calls" if calls else "stop")
    chunks = answer(limits, body, text, stream=True)
    s_content, s_calls, s_reason = joined(chunks)
    assert s_reason == whole["finish_reason"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in s_calls] == calls
    assert s_content == content  # the deltas join to the non-streamed content
    assert not any("<tool" in (ch["delta"]["content"] or "") for ch in chunks)  # held back, never streamed
    assert all(c["id"].startswith("call_") for c in s_calls + message.get("tool_calls", []))


@pytest.mark.parametrize(
    ("body", "text", "content", "calls"),
    [
        ({}, "It is sunny in Paris.", "It is sunny in Paris.", []),
        ({}, PARIS, None, [("get_weather", PARIS_ARGS)]),
        ({}, f"[{ONE_NOW}, {PARIS}]", None, [("now", "{}"), ("get_weather", PARIS_ARGS)]),
        ({"parallel_tool_calls": False}, ONE_NOW, None, [("now", "{}")]),
    ],
)  # fmt: skip
def test_auto_without_template_tools_answers_streamed_and_not_alike(
    smol: RequestLimits, body: dict[str, Any], text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    body = {"tools": [WEATHER, NOW], **body}
    whole = answer(smol, body, text, stream=False)
    got = [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"].get("tool_calls", [])
    ]
    assert (whole["message"]["content"], got) == (content, calls)
    assert whole["finish_reason"] == ("tool_calls" if calls else "stop")
    s_content, s_calls, s_reason = joined(answer(smol, body, text, stream=True))
    assert (s_content, s_reason) == (content, whole["finish_reason"])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in s_calls] == calls
