"""Every field of vLLM's own request models (vLLM 0.32's ChatCompletionRequest and
CompletionRequest, listed in data/vllm_request_fields.json with vLLM's defaults) is honoured or
refused with a 400 that names it and says why; none is an "unknown field", and a field at vLLM's
default (a value that asks for nothing) is always accepted.

Two walks: the parser (each client value honoured, i.e. the parsed request differs from the same
request without it, or refused, as the table here expects), and a served tiny model over HTTP
(each field at a client's value and at its default: no "unknown field", no 5xx, every 400 naming
the field with a reason). docs/serve.md's table has a row for every field of the list.
"""

from __future__ import annotations

import json
import pathlib
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.frontend.serve import openai_fields
from pagedkv.frontend.serve.openai_api import ApiError, RequestLimits, parse_chat, parse_completion
from pagedkv.frontend.serve.server import OpenAIServer
from pagedkv.frontend.serve.text import load_model_text
from tests.frontend.serve_fixtures import model_with_tokenizer, save_tokenizer, serving, stack_config
from tests.worker_svc.conftest import HFModel

ROOT = pathlib.Path(__file__).resolve().parents[3]
FIELDS = json.loads((pathlib.Path(__file__).parent / "data" / "vllm_request_fields.json").read_text())
REQUIRED = "<required>"

# Renders the template variables vLLM's chat fields set, so a dropped one changes the prompt; each
# turn ends with w23 (what continue_final_message leaves out).
TEMPLATE = (
    "{% if tools %}system w14 {% endif %}"
    "{% if documents %}w21 {% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}w20 {% endif %}"
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} w23 {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT_BASE: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "w7 w8"}],
    "max_tokens": 2,
}
COMPLETION_BASE: dict[str, Any] = {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 2}
ANSWERED = [{"role": "user", "content": "w7 w8"}, {"role": "assistant", "content": "w9"}]

# A value a client sends for each field (and what else the request needs for it to mean that).
# The context goes in the base too: the field is compared with the same request without it.
SAMPLES: dict[str, tuple[Any, dict[str, Any]]] = {
    "add_generation_prompt": (False, {}),
    "allowed_token_ids": ([7, 8, 9], {}),
    "bad_words": (["w9"], {}),
    "cache_salt": ("tenant-a", {}),
    "chat_template": ("{% for m in messages %}{{ m['content'] }}{% endfor %}", {}),
    "chat_template_kwargs": ({"enable_thinking": False}, {}),
    "continue_final_message": (True, {"messages": ANSWERED, "add_generation_prompt": False}),
    "documents": ([{"title": "t", "text": "w22"}], {}),
    "ec_transfer_params": ({"ec_connector": "x"}, {}),
    "echo": (True, {}),
    "frequency_penalty": (0.5, {}),
    "ignore_eos": (True, {}),
    "include_reasoning": (False, {}),
    "include_stop_str_in_output": (True, {"stop": ["w5"]}),
    "kv_transfer_params": ({"do_remote_prefill": True}, {}),
    "length_penalty": (0.8, {"use_beam_search": True}),  # (it scores beams: refused without them)
    "logit_bias": ({"5": 3.0}, {}),
    "logprob_token_ids": ([5, 6], {}),
    "max_completion_tokens": (3, {}),
    "max_tokens": (3, {}),
    "media_io_kwargs": ({"video": {"num_frames": 8}}, {}),
    "messages": ([{"role": "user", "content": "w9"}], {}),
    "min_p": (0.1, {}),
    "min_tokens": (2, {}),
    "mm_payload": ("base64", {}),
    "mm_processor_kwargs": ({"num_crops": 4}, {}),
    "model": ("another-model", {}),
    "n": (2, {}),
    "parallel_tool_calls": (False, {"tools": [TOOL]}),
    "presence_penalty": (0.5, {}),
    "priority": (-5, {}),
    "prompt": ([4, 5], {}),
    "prompt_embeds": ("AAAA", {}),
    "prompt_logprobs": (1, {}),
    "reasoning_effort": ("low", {}),
    "repetition_detection": ({"min_repetitions": 3}, {}),
    "repetition_penalty": (1.2, {}),
    "request_id": ("req-42", {}),
    "response_format": ({"type": "json_object"}, {}),
    "return_mm_kwargs": (True, {}),
    "return_prompt_text": (True, {}),
    "return_token_ids": (True, {}),
    "return_token_offsets": (True, {}),
    "return_tokens_as_token_ids": (True, {}),
    "routed_experts_prompt_start": (4, {}),
    "seed": (3, {}),
    "session_id": ("session-1", {}),
    "skip_special_tokens": (False, {}),
    "spaces_between_special_tokens": (False, {"skip_special_tokens": False}),
    "stop": (["w5"], {}),
    "stop_token_ids": ([9], {}),
    "stream": (True, {}),
    "stream_interval": (4, {}),
    "stream_options": ({"include_usage": True}, {"stream": True}),
    "structured_outputs": ({"choice": ["w7", "w8"]}, {}),
    "suffix": ("w9", {}),
    "temperature": (0.5, {}),
    "thinking_token_budget": (256, {}),
    "tool_choice": ("required", {"tools": [TOOL]}),
    "tools": ([TOOL], {}),
    "top_k": (5, {}),
    "top_logprobs": (3, {"logprobs": True}),
    "top_p": (0.5, {}),
    "truncate_prompt_tokens": (2, {}),
    "truncation_side": ("right", {"truncate_prompt_tokens": 2}),
    "use_beam_search": (True, {}),
    "user": ("someone", {}),
    "vllm_xargs": ({"my_processor_arg": 1}, {}),
    "watermarking": ({"key": 7}, {}),
}
# Where the request differs from the plain one (chat: an answer to echo; completions: text).
CHAT_CONTEXT = {"echo": {"messages": ANSWERED}, "return_tokens_as_token_ids": {"logprobs": True}}
COMPLETION_CONTEXT = {"return_tokens_as_token_ids": {"logprobs": 1}}
SAMPLES_BY_KIND = {
    "chat": {**SAMPLES, "add_special_tokens": (True, {}), "logprobs": (True, {})},
    "completions": {**SAMPLES, "add_special_tokens": (False, {"prompt": "w7 w8"}), "logprobs": (2, {})},
}
CONTEXT_BY_KIND = {"chat": CHAT_CONTEXT, "completions": COMPLETION_CONTEXT}
# What each field's client value gets; every other one is honoured.
REFUSED = {
    "chat_template",
    "ec_transfer_params",
    "include_reasoning",
    "kv_transfer_params",
    "logprob_token_ids",
    "media_io_kwargs",
    "mm_payload",
    "mm_processor_kwargs",
    "model",  # another model: 404 naming it
    "prompt_embeds",
    "reasoning_effort",
    "repetition_detection",
    "return_mm_kwargs",
    "return_prompt_text",
    "return_token_offsets",
    "routed_experts_prompt_start",
    "session_id",
    "stream_interval",
    "suffix",
    "thinking_token_budget",
    "vllm_xargs",
    "watermarking",
}
IGNORED = {"user"}
PARSERS = {"chat": parse_chat, "completions": parse_completion}
BASES = {"chat": CHAT_BASE, "completions": COMPLETION_BASE}
POLICIES = {"chat": openai_fields.CHAT, "completions": openai_fields.COMPLETION}
WALK = [(kind, name) for kind in ("chat", "completions") for name in sorted(FIELDS[kind])]


@pytest.fixture(scope="module")
def limits(tmp_path_factory: pytest.TempPathFactory) -> RequestLimits:
    path = tmp_path_factory.mktemp("vllm-fields-tokenizer")
    save_tokenizer(path)
    text = load_model_text(str(path))
    text.tokenizer.chat_template = TEMPLATE
    text.tokenizer._place_bos_eos(True, False)  # a tokenizer that puts BOS before a text
    return RequestLimits("tiny", 128, 4, 64, text, tool_call_parser="hermes", scheduling_policy="priority")


def _request(kind: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the request without the field, the request with its client value)."""
    value, context = SAMPLES_BY_KIND[kind][name]
    context = {**context, **CONTEXT_BY_KIND[kind].get(name, {})}
    base = {**BASES[kind], **context}
    return base, {**base, name: value}


def test_the_list_is_vllm_0_32s() -> None:
    assert FIELDS["source"].startswith("vLLM 0.32.0")
    assert len(FIELDS["chat"]) > 60 and len(FIELDS["completions"]) > 50
    for kind in ("chat", "completions"):
        assert set(SAMPLES_BY_KIND[kind]) >= set(FIELDS[kind]), "a new field: give it a client's value"


@pytest.mark.parametrize(("kind", "name"), WALK)
def test_each_vllm_field_is_honoured_or_refused_with_its_reason(
    kind: str, name: str, limits: RequestLimits
) -> None:
    parse = PARSERS[kind]
    base, with_field = _request(kind, name)
    want = parse(base, limits)
    try:
        got = parse(with_field, limits)
    except ApiError as e:
        assert "unknown field" not in e.message, e.message
        assert e.status in (400, 404) and e.param == name, (e.param, e.message)
        if name != "model":  # another model: 404 model_not_found, OpenAI's wording
            assert e.message.startswith(f"{name}: ") and len(e.message) > len(name) + 20, e.message
        # The tiny word vocabulary cannot spell JSON: refused for that, naming the field
        # (test_vllm_extensions.py checks response_format against SmolLM2's vocabulary).
        vocabulary = name in ("response_format", "tool_choice") and "vocabulary" in e.message
        assert name in REFUSED or vocabulary, f"{name} ({kind}) is refused: {e.message}"
        return
    assert name not in REFUSED, f"{name} ({kind}) should be refused"
    if name in IGNORED:
        assert got == want and isinstance(POLICIES[kind].get(name), openai_fields.Ignored)
    else:
        assert got != want, f"{name} ({kind}) changes nothing: dropped without being listed as ignored"


@pytest.mark.parametrize(("kind", "name"), WALK)
def test_each_vllm_field_at_vllms_default_asks_for_nothing(
    kind: str, name: str, limits: RequestLimits
) -> None:
    default = FIELDS[kind][name]
    if default == REQUIRED or name == "prompt":  # the prompt itself (null is no prompt)
        return
    base = {k: v for k, v in BASES[kind].items() if k != "max_tokens"}
    assert PARSERS[kind]({**base, name: default}, limits) == PARSERS[kind](base, limits), (name, default)


def test_every_field_at_once_at_its_default(limits: RequestLimits) -> None:
    """What a client built on vLLM's own request model sends: every field, at its default."""
    for kind in ("chat", "completions"):
        base = {k: v for k, v in BASES[kind].items() if k != "max_tokens"}
        body = {k: v for k, v in FIELDS[kind].items() if v != REQUIRED and k != "prompt"}
        assert PARSERS[kind]({**body, **base}, limits) == PARSERS[kind](base, limits)


def test_priority_is_refused_naming_the_setting_when_scheduling_is_first_come(limits: RequestLimits) -> None:
    fcfs = RequestLimits("tiny", 128, 4, 64, limits.text)
    with pytest.raises(ApiError) as e:
        parse_chat({**CHAT_BASE, "priority": -5}, fcfs)
    assert e.value.param == "priority" and "--scheduling-policy priority" in e.value.message
    assert parse_chat({**CHAT_BASE, "priority": 0}, fcfs) == parse_chat(CHAT_BASE, fcfs)


def _docs_rows() -> dict[str, str]:
    text = (ROOT / "docs" / "serve.md").read_text()
    section = text.split("## Request fields", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): line for line in section.splitlines() if (m := re.match(r"\| `([a-z_.]+)`", line))}


def test_docs_table_has_every_vllm_field() -> None:
    rows = _docs_rows()
    names = set(FIELDS["chat"]) | set(FIELDS["completions"])
    missing = sorted(names - set(rows))
    assert not missing, f"docs/serve.md's field table has no row for {missing}"
    for name in names & REFUSED - {"model"}:
        assert "400" in rows[name], f"docs/serve.md: the row of {name} should say '400': {rows[name]!r}"


# --- over HTTP, against a served tiny model ---------------------------------------------------------
@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return model_with_tokenizer(tmp_path_factory.mktemp("vllm-fields-model"))


@pytest.fixture(scope="module")
def server(hf: HFModel) -> Iterator[OpenAIServer]:
    with (
        LocalStack(stack_config(hf, num_gpu_blocks=96)) as stack,
        serving(stack, model=str(hf.path), model_name="tiny", scheduling_policy="priority") as srv,
    ):
        srv.state.limits.text.tokenizer.chat_template = TEMPLATE  # one that renders tools
        srv.state.limits.tool_call_parser = "hermes"
        yield srv


def post(server: OpenAIServer, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any] | str]:
    req = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read().decode()
            return r.status, json.loads(raw) if not body.get("stream") else raw
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def test_every_vllm_field_over_http_at_a_clients_value_and_at_its_default(server: OpenAIServer) -> None:
    """A refusal here may also be the tiny model's (its word vocabulary cannot spell JSON, so a
    JSON constraint is refused naming the field): the parser walk above holds each field to its
    outcome."""
    paths = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
    problems = []
    for kind, name in WALK:
        _, with_field = _request(kind, name)
        with_field = {**with_field, "max_tokens": min(with_field.get("max_tokens", 2), 3)}
        default = FIELDS[kind][name]
        sends = [("client value", with_field)]
        if default != REQUIRED and name != "prompt":
            # (chat's max_tokens at its default is the whole context: max_completion_tokens bounds it)
            bound = {"max_completion_tokens": 2} if kind == "chat" and name == "max_tokens" else {}
            sends.append(("default", {**BASES[kind], **bound, name: default}))
        for what, body in sends:
            status, got = post(server, paths[kind], body)
            err = got.get("error", {}) if isinstance(got, dict) else {}
            if status >= 500:
                problems.append(f"{kind} {name} ({what}): {status} {got}")
            elif status != 200 and (
                "unknown field" in err.get("message", "")
                or err.get("param") != name
                or len(err.get("message", "")) < len(name) + 20  # no reason given
                or what == "default"
            ):
                problems.append(f"{kind} {name} ({what}): {status} {err}")
    assert not problems, "\n".join(problems)
