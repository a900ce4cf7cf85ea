"""Nothing silently dropped: every field of the `openai` SDK's own completions and chat request
types (and of each message and content part) is honoured or refused with a 400 naming it, unless
frontend/serve/openai_fields.py lists it as ignored with a reason; docs/serve.md's table has a row for
each. Pure parsing (frontend/serve/openai_api.py), no processes.

"Honoured" means the parsed request differs from the same request without the field: a field the
parser dropped would leave it equal, and would have to be listed as ignored to pass.
"""

from __future__ import annotations

import pathlib
import re
import typing
from typing import Any

import pytest

from pagedkv.frontend.serve import openai_fields
from pagedkv.frontend.serve.openai_api import ApiError, Parsed, RequestLimits, parse_chat, parse_completion
from pagedkv.frontend.serve.text import load_model_text
from tests.frontend.serve_fixtures import save_tokenizer

openai = pytest.importorskip("openai")
from openai.types import completion_create_params as completion_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_params  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]
# Renders every message key the server gives the template, so a dropped one changes the prompt
# (and the tools, so that it is a template that renders tools).
TEMPLATE = (
    "{% if tools %}system w14 {% endif %}"
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}"
    "{% if m['name'] is defined %} w{{ m['name'] }}{% endif %}"
    "{% if m['tool_calls'] is defined %} w15{% endif %}"
    "{% if m['tool_call_id'] is defined %} w{{ m['tool_call_id'] }}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


@pytest.fixture(scope="module")
def limits(tmp_path_factory: pytest.TempPathFactory) -> RequestLimits:
    path = tmp_path_factory.mktemp("fields-tokenizer")
    save_tokenizer(path)
    text = load_model_text(str(path))
    text.tokenizer.chat_template = TEMPLATE
    return RequestLimits("tiny", 128, 4, 64, text, tool_call_parser="hermes")


def sdk_fields(typed_dict: type) -> list[str]:
    return sorted(typing.get_type_hints(typed_dict))


CHAT_BASE: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "w7 w8"}]}
COMPLETION_BASE: dict[str, Any] = {"model": "tiny", "prompt": [1, 2, 3]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# A value of each field that asks for something, and what else the request needs for it to mean
# that (a request differing only in the field is compared with the same request without it).
CHAT_SAMPLES: dict[str, tuple[Any, dict[str, Any]]] = {
    "audio": ({"voice": "alloy", "format": "wav"}, {}),
    "frequency_penalty": (0.5, {}),
    "function_call": ("auto", {}),
    "functions": ([{"name": "f", "parameters": {}}], {}),
    "logit_bias": ({"5": 3.0}, {}),
    "logprobs": (True, {}),
    "max_completion_tokens": (5, {}),
    "max_tokens": (5, {}),
    "messages": ([{"role": "user", "content": "w9"}], {}),
    "metadata": ({"k": "v"}, {}),
    "modalities": (["text", "audio"], {}),
    "model": ("another-model", {}),
    "moderation": ({"model": "omni-moderation-latest"}, {}),
    "n": (2, {}),
    "parallel_tool_calls": (False, {"tools": [TOOL]}),
    "prediction": ({"type": "content", "content": "w9"}, {}),
    "presence_penalty": (0.5, {}),
    "prompt_cache_key": ("k", {}),
    "prompt_cache_options": ({"mode": "explicit"}, {}),
    "prompt_cache_retention": ("24h", {}),
    "reasoning_effort": ("low", {}),
    "response_format": ({"type": "json_object"}, {}),
    "safety_identifier": ("someone", {}),
    "seed": (3, {}),
    "service_tier": ("flex", {}),
    "stop": (["w5"], {}),
    "store": (True, {}),
    "stream": (True, {}),
    "stream_options": ({"include_usage": True}, {"stream": True}),
    "temperature": (0.5, {}),
    "tool_choice": ("required", {"tools": [TOOL]}),
    "tools": ([TOOL], {}),
    "top_logprobs": (3, {"logprobs": True}),
    "top_p": (0.5, {}),
    "user": ("someone", {}),
    "verbosity": ("low", {}),
    "web_search_options": ({}, {}),
}
COMPLETION_SAMPLES: dict[str, tuple[Any, dict[str, Any]]] = {
    "best_of": (3, {}),
    "echo": (True, {}),
    "frequency_penalty": (0.5, {}),
    "logit_bias": ({"5": 3.0}, {}),
    "logprobs": (2, {}),
    "max_tokens": (5, {}),
    "model": ("another-model", {}),
    "n": (2, {}),
    "presence_penalty": (0.5, {}),
    "prompt": ([4, 5], {}),
    "seed": (3, {}),
    "stop": (["w5"], {}),
    "stream": (True, {}),
    "stream_options": ({"include_usage": True}, {"stream": True}),
    "suffix": ("w9", {}),
    "temperature": (0.5, {}),
    "top_p": (0.5, {}),
    "user": ("someone", {}),
}
STREAM_OPTIONS_SAMPLES: dict[str, Any] = {"include_usage": True, "include_obfuscation": False}
# Per role: a message of that role, and a value for each of its fields.
MESSAGE_BASE: dict[str, dict[str, Any]] = {
    "system": {"role": "system", "content": "w5"},
    "developer": {"role": "developer", "content": "w5"},
    "user": {"role": "user", "content": "w5"},
    "assistant": {"role": "assistant", "content": "w5"},
    "tool": {"role": "tool", "content": "w5", "tool_call_id": "9"},
    "function": {"role": "function", "content": "w5", "name": "f"},
}
MESSAGE_SAMPLES: dict[str, Any] = {
    "content": "w6",
    "name": "11",
    "role": "user",
    "audio": {"id": "audio-1"},
    "function_call": {"name": "f", "arguments": "{}"},
    "refusal": " w12",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    "tool_call_id": "13",
}
MESSAGE_TYPES = {
    "system": "ChatCompletionSystemMessageParam",
    "developer": "ChatCompletionDeveloperMessageParam",
    "user": "ChatCompletionUserMessageParam",
    "assistant": "ChatCompletionAssistantMessageParam",
    "tool": "ChatCompletionToolMessageParam",
    "function": "ChatCompletionFunctionMessageParam",
}


def outcome(
    parse: Any, base: dict[str, Any], field_path: str, with_field: dict[str, Any], limits: RequestLimits
) -> str:
    """'honoured', 'refused' (a 4xx naming the field) or 'ignored' (parsed the same as without)."""
    try:
        got = parse(with_field, limits)
    except ApiError as e:
        assert e.status in (400, 404), e.message
        assert e.param is not None and (e.param == field_path or e.param.startswith(field_path + ".")), (
            f"{field_path}: the error names {e.param!r}: {e.message}"
        )
        return "refused"
    want: Parsed = parse(base, limits)
    return "ignored" if got == want else "honoured"


def assert_allowed(result: str, name: str, policy: openai_fields.Policy) -> None:
    rule = policy.get(name)
    if result == "ignored":
        assert isinstance(rule, openai_fields.Ignored), f"{name} is dropped without being listed as ignored"
        assert rule.reason
    else:
        assert not isinstance(rule, openai_fields.Ignored), f"{name} is listed as ignored but it is {result}"


@pytest.mark.parametrize("name", sdk_fields(chat_params.CompletionCreateParamsStreaming))
def test_every_chat_field_of_the_sdk_is_honoured_or_refused(name: str, limits: RequestLimits) -> None:
    assert name in CHAT_SAMPLES, f"a new SDK field: add a sample value for {name} (and decide what it does)"
    value, context = CHAT_SAMPLES[name]
    base = {**CHAT_BASE, **context}
    result = outcome(parse_chat, base, name, {**base, name: value}, limits)
    assert_allowed(result, name, openai_fields.CHAT)


@pytest.mark.parametrize("name", sdk_fields(completion_params.CompletionCreateParamsStreaming))
def test_every_completion_field_of_the_sdk_is_honoured_or_refused(name: str, limits: RequestLimits) -> None:
    assert name in COMPLETION_SAMPLES, f"a new SDK field: add a sample value for {name}"
    value, context = COMPLETION_SAMPLES[name]
    base = {**COMPLETION_BASE, **context}
    result = outcome(parse_completion, base, name, {**base, name: value}, limits)
    assert_allowed(result, name, openai_fields.COMPLETION)


@pytest.mark.parametrize("name", sdk_fields(chat_params.ChatCompletionStreamOptionsParam))
def test_every_stream_option_is_honoured_or_refused(name: str, limits: RequestLimits) -> None:
    base = {**CHAT_BASE, "stream": True, "stream_options": {}}
    with_field = {**base, "stream_options": {name: STREAM_OPTIONS_SAMPLES[name]}}
    result = outcome(parse_chat, base, f"stream_options.{name}", with_field, limits)
    assert_allowed(result, name, openai_fields.STREAM_OPTIONS)


@pytest.mark.parametrize(
    ("role", "name"),
    [
        (role, name)
        for role, type_name in MESSAGE_TYPES.items()
        for name in sdk_fields(getattr(openai.types.chat, type_name))
    ],
)
def test_every_message_field_of_the_sdk_is_honoured_or_refused(
    role: str, name: str, limits: RequestLimits
) -> None:
    assert name in MESSAGE_SAMPLES, f"a new SDK message field: add a sample value for {name}"
    message = MESSAGE_BASE[role]
    base = {**CHAT_BASE, "messages": [{"role": "user", "content": "w7"}, message]}
    if role == "function":  # the role itself is refused, so there is no valid base to compare with
        with pytest.raises(ApiError) as e:
            parse_chat(base, limits)
        assert e.value.status == 400 and e.value.param == "messages.1.role"
        return
    value = MESSAGE_SAMPLES[name]
    if name == "role":  # another role than the message's own (one the test vocabulary spells)
        value = "system" if role != "system" else "user"
    changed = {**message, name: value}
    result = outcome(
        parse_chat, base, f"messages.1.{name}", {**base, "messages": [base["messages"][0], changed]}, limits
    )
    assert_allowed(result, name, openai_fields.MESSAGE)


CONTENT_PARTS = {
    "ChatCompletionContentPartTextParam": {"type": "text", "text": "w6"},
    "ChatCompletionContentPartImageParam": {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
    "ChatCompletionContentPartInputAudioParam": {
        "type": "input_audio",
        "input_audio": {"data": "", "format": "wav"},
    },
    "File": {"type": "file", "file": {"file_id": "f"}},
}


@pytest.mark.parametrize("part_type", typing.get_args(openai.types.chat.ChatCompletionContentPartParam))
def test_every_content_part_is_honoured_or_refused(part_type: type, limits: RequestLimits) -> None:
    part = CONTENT_PARTS[part_type.__name__]
    base = {**CHAT_BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "w7"}]}]}
    with_part = {
        **CHAT_BASE,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "w7"}, part]}],
    }
    result = outcome(parse_chat, base, "messages.0.content.1", with_part, limits)
    assert result == ("honoured" if part["type"] == "text" else "refused")
    for name in sdk_fields(part_type):  # each of its fields (prompt_cache_breakpoint: a cache hint)
        if name in part:
            continue
        listed = openai_fields.CONTENT_PART.get(name)
        assert isinstance(listed, openai_fields.Ignored), f"content part field {name} is not decided"
        with_hint = {
            **CHAT_BASE,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "w7", name: {}}]}],
        }
        assert outcome(parse_chat, base, f"messages.0.content.0.{name}", with_hint, limits) == "ignored"


@pytest.mark.parametrize(
    ("parse", "base"),
    [(parse_chat, CHAT_BASE), (parse_completion, COMPLETION_BASE)],
    ids=["chat", "completion"],
)
@pytest.mark.parametrize(
    "name", ["definitely_not_a_field", "max_new_tokens", "guided_grammar", "stream_optons"]
)
def test_unknown_fields_are_refused_naming_them(
    parse: Any, base: dict[str, Any], name: str, limits: RequestLimits
) -> None:
    with pytest.raises(ApiError) as e:
        parse({**base, name: 1}, limits)
    assert e.value.status == 400 and e.value.param == name
    assert e.value.message.startswith(f"{name}: unknown field")
    with pytest.raises(ApiError) as e:
        parse({**base, "stream": True, "stream_options": {"include_usage": True, name: 1}}, limits)
    assert e.value.param == f"stream_options.{name}"


def test_neutral_values_of_refused_fields_are_accepted(limits: RequestLimits) -> None:
    """What clients send by default (store: false, modalities: ["text"], an empty tools list...)."""
    want = parse_chat(CHAT_BASE, limits)
    for name, rule in openai_fields.CHAT.items():
        if isinstance(rule, openai_fields.Refused):
            for value in rule.neutral:
                assert parse_chat({**CHAT_BASE, name: value}, limits) == want, (name, value)


def _docs_rows() -> dict[str, str]:
    text = (ROOT / "docs" / "serve.md").read_text()
    section = text.split("## Request fields", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): line for line in section.splitlines() if (m := re.match(r"\| `([a-z_.]+)`", line))}


def test_docs_table_says_what_happens_to_every_field() -> None:
    rows = _docs_rows()
    names = (
        set(sdk_fields(chat_params.CompletionCreateParamsStreaming))
        | set(sdk_fields(completion_params.CompletionCreateParamsStreaming))
        | {f"stream_options.{n}" for n in sdk_fields(chat_params.ChatCompletionStreamOptionsParam)}
        | {f"messages.{n}" for t in MESSAGE_TYPES.values() for n in sdk_fields(getattr(openai.types.chat, t))}
    )
    missing = sorted(names - set(rows))
    assert not missing, f"docs/serve.md's field table has no row for {missing}"
    policies = {
        "": {**openai_fields.CHAT, **openai_fields.COMPLETION},
        "stream_options.": openai_fields.STREAM_OPTIONS,
        "messages.": openai_fields.MESSAGE,
    }
    for prefix, policy in policies.items():
        for name, rule in policy.items():
            row = rows.get(prefix + name, "")
            word = "ignored" if isinstance(rule, openai_fields.Ignored) else "400"
            assert word in row, f"docs/serve.md: the row of {prefix}{name} should say {word!r}: {row!r}"
