"""vLLM's request extensions do what they say, end to end against a served tiny model (and each test
fails when its mechanism is removed): token constraints (allowed_token_ids, bad_words, min_tokens),
detokenization switches, echo/continue_final_message/chat_template_kwargs, return_token_ids,
request_id, truncation, structured_outputs, prompt_logprobs (vLLM's JSON shape, in each completion
choice and beside a chat's choices); plus response_format on completions, a json_schema without
"strict" enforced, and /tokenize's add_special_tokens, against SmolLM2's real vocabulary.
"""

from __future__ import annotations

import json
import pathlib
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.frontend.serve.openai_api import RequestLimits, parse_chat, parse_completion
from pagedkv.frontend.serve.server import OpenAIServer
from pagedkv.frontend.serve.text import ModelText
from pagedkv.frontend.serve.tokenize_api import tokenize
from tests.frontend.serve_fixtures import WORDS, model_with_tokenizer, serving, stack_config
from tests.worker_svc.conftest import HFModel

EOS = 2  # </s>
TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}w20 {% endif %}"
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} w23 {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return model_with_tokenizer(tmp_path_factory.mktemp("vllm-ext-model"))


@pytest.fixture(scope="module")
def server(hf: HFModel) -> Iterator[OpenAIServer]:
    with (
        LocalStack(stack_config(hf, num_gpu_blocks=96)) as stack,
        serving(stack, model=str(hf.path), model_name="tiny") as srv,
    ):
        srv.state.limits.text.tokenizer.chat_template = TEMPLATE
        yield srv


def post(
    server: OpenAIServer, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any, Any]:
    req = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read().decode()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode()), e.headers


def complete(server: OpenAIServer, **body: Any) -> dict[str, Any]:
    status, got, _ = post(server, "/v1/completions", {"model": "tiny", "temperature": 0, **body})
    assert status == 200, got
    return got  # type: ignore[no-any-return]


def chat(server: OpenAIServer, **body: Any) -> dict[str, Any]:
    status, got, _ = post(server, "/v1/chat/completions", {"model": "tiny", "temperature": 0, **body})
    assert status == 200, got
    return got  # type: ignore[no-any-return]


PROMPT = [5, 9, 17, 33, 64, 7]


def test_allowed_token_ids_and_the_detokenization_switches(server: OpenAIServer) -> None:
    base = {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "allowed_token_ids": [EOS]}
    r = complete(server, **base)
    assert r["choices"][0]["token_ids"] == [EOS] * 3
    assert r["choices"][0]["text"] == ""  # special tokens skipped by default
    r = complete(server, **base, skip_special_tokens=False)
    assert r["choices"][0]["text"] == "</s> </s> </s>"  # the tokenizer's decoding sets them apart
    r = complete(server, **base, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert r["choices"][0]["text"] == "</s></s></s>"


def test_bad_words_change_the_greedy_answer(server: OpenAIServer) -> None:
    plain = complete(server, prompt=PROMPT, max_tokens=4, ignore_eos=True)["choices"][0]
    first = plain["text"].split()[0]
    banned = complete(server, prompt=PROMPT, max_tokens=4, ignore_eos=True, bad_words=[first])["choices"][0]
    assert first not in banned["text"].split(), (plain["text"], banned["text"])


def test_min_tokens_holds_off_the_stop_tokens(server: OpenAIServer) -> None:
    eager = {"prompt": PROMPT, "max_tokens": 6, "logit_bias": {str(EOS): 100}}
    assert complete(server, **eager)["choices"][0]["token_ids"] == [EOS]
    r = complete(server, **eager, min_tokens=4)["choices"][0]
    assert len(r["token_ids"]) == 5 and EOS not in r["token_ids"][:4] and r["token_ids"][4] == EOS


def test_include_stop_str_in_output(server: OpenAIServer) -> None:
    words = complete(server, prompt=PROMPT, max_tokens=5, ignore_eos=True)["choices"][0]["text"].split()
    stop = words[2]
    cut = complete(server, prompt=PROMPT, max_tokens=5, ignore_eos=True, stop=[stop])["choices"][0]
    kept = complete(
        server, prompt=PROMPT, max_tokens=5, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )["choices"][0]
    assert not cut["text"].rstrip().endswith(stop)
    assert kept["text"].endswith(stop) and kept["text"].startswith(cut["text"].rstrip())


def test_return_token_ids_request_id_and_truncation(server: OpenAIServer) -> None:
    long = list(range(10, 30))
    r = complete(server, prompt=long, max_tokens=2, return_token_ids=True, truncate_prompt_tokens=4)
    assert r["choices"][0]["prompt_token_ids"] == long[-4:] and r["usage"]["prompt_tokens"] == 4
    r = complete(
        server,
        prompt=long,
        max_tokens=2,
        return_token_ids=True,
        truncate_prompt_tokens=4,
        truncation_side="right",
    )
    assert r["choices"][0]["prompt_token_ids"] == long[:4]
    assert "prompt_token_ids" not in complete(server, prompt=long, max_tokens=2)["choices"][0]
    status, got, headers = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "w7"}], "request_id": "abc-1"},
    )
    assert status == 200 and got["id"] == "chatcmpl-abc-1" and headers["X-Request-Id"] == "abc-1"
    status, got, headers = post(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, headers={"X-Request-Id": "hdr-2"}
    )
    assert got["id"] == "cmpl-hdr-2" and headers["X-Request-Id"] == "hdr-2"


def test_the_chat_template_switches_reach_the_prompt(server: OpenAIServer) -> None:
    user = [{"role": "user", "content": "w7 w8"}]
    answered = [*user, {"role": "assistant", "content": "w9 w10"}]
    assert chat(server, messages=user, max_tokens=1, return_token_ids=True)["prompt_token_ids"] == [
        4,
        7,
        8,
        23,
        5,
    ]
    r = chat(server, messages=user, max_tokens=1, return_token_ids=True, add_generation_prompt=False)
    assert r["prompt_token_ids"] == [4, 7, 8, 23]
    r = chat(
        server,
        messages=user,
        max_tokens=1,
        return_token_ids=True,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert r["prompt_token_ids"] == [20, 4, 7, 8, 23, 5]
    r = chat(
        server,
        messages=answered,
        max_tokens=2,
        ignore_eos=True,
        return_token_ids=True,
        add_generation_prompt=False,
        continue_final_message=True,
        echo=True,
    )
    assert r["prompt_token_ids"] == [4, 7, 8, 23, 5, 9, 10]  # the answer's turn left open
    assert r["choices"][0]["message"]["content"].startswith("w9 w10")  # echoed


def test_structured_outputs_choice_regex_and_grammar(server: OpenAIServer) -> None:
    for so, ok in (
        ({"choice": ["w40", "w41"]}, {"w40", "w41"}),
        ({"regex": "w5[0-3]"}, {"w50", "w51", "w52", "w53"}),
        ({"grammar": 'root ::= "assistant"'}, {"assistant"}),
    ):
        r = complete(server, prompt=PROMPT, max_tokens=4, structured_outputs=so)["choices"][0]
        assert r["text"] in ok and r["finish_reason"] == "stop", (so, r)


def _check_prompt_logprobs(got: list[Any], prompt: list[int], hf: HFModel, num_top: int) -> None:
    """vLLM's shape: null first, then per token {id: {logprob, rank, decoded_token}}, the token's
    own entry first and then the num_top most likely (rank 1..), against transformers."""
    with torch.inference_mode():
        ref = torch.log_softmax(hf.model(torch.tensor([prompt])).logits[0].float(), -1)  # type: ignore[operator]
    assert len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        entry, row = got[pos], ref[pos - 1]
        token = str(prompt[pos])
        assert next(iter(entry)) == token  # the prompt's own token comes first
        top = row.topk(num_top)
        assert list(entry)[1:] == [str(t) for t in top.indices.tolist() if str(t) != token]
        for key, v in entry.items():
            assert set(v) == {"logprob", "rank", "decoded_token"}
            assert v["logprob"] == pytest.approx(float(row[int(key)]), abs=1e-4)
            assert v["decoded_token"] == WORDS[int(key)]  # the tokenizer's text of the token alone
        assert entry[token]["rank"] == int((row >= row[prompt[pos]]).sum())
        ranks = {str(t): r for r, t in enumerate(top.indices.tolist(), start=1)}
        assert all(entry[k]["rank"] == ranks[k] for k in ranks)


def test_prompt_logprobs_in_vllms_shape_for_completions_and_chat(server: OpenAIServer, hf: HFModel) -> None:
    r = complete(server, prompt=PROMPT, max_tokens=2, n=2, prompt_logprobs=2)
    assert r["choices"][0]["prompt_logprobs"] == r["choices"][1]["prompt_logprobs"]  # n: one prompt
    _check_prompt_logprobs(r["choices"][0]["prompt_logprobs"], PROMPT, hf, 2)
    two = complete(server, prompt=[PROMPT, PROMPT[:3]], max_tokens=1, prompt_logprobs=0)["choices"]
    assert len(two[1]["prompt_logprobs"]) == 3  # each choice its own prompt's
    _check_prompt_logprobs(two[1]["prompt_logprobs"], PROMPT[:3], hf, 0)
    assert "prompt_logprobs" not in complete(server, prompt=PROMPT, max_tokens=1)["choices"][0]
    c = chat(
        server,
        messages=[{"role": "user", "content": "w7 w8"}],
        max_tokens=2,
        prompt_logprobs=1,
        return_token_ids=True,
    )
    assert "prompt_logprobs" not in c["choices"][0]  # vLLM puts it beside the choices
    _check_prompt_logprobs(c["prompt_logprobs"], c["prompt_token_ids"], hf, 1)
    # A stream carries none (as vLLM's): 0 is accepted, more is refused.
    status, raw = _stream(server, {"prompt": PROMPT, "max_tokens": 2, "stream": True, "prompt_logprobs": 0})
    assert status == 200 and "prompt_logprobs" not in raw and raw.endswith("data: [DONE]\n\n")


def _stream(server: OpenAIServer, body: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(
        server.url + "/v1/completions",
        json.dumps({"model": "tiny", **body}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, r.read().decode()


@pytest.mark.parametrize(
    ("value", "extra", "says"),
    [
        (21, {}, "at most 20 alternatives per position"),
        (-1, {}, "-1 asks for the whole vocabulary (128 tokens)"),
        (-2, {}, "must be -1 (the whole vocabulary) or >= 0"),
        ("1", {}, "valid integer"),
        (1, {"stream": True}, "not available with stream: true"),
        (-1, {"stream": True}, "not available with stream: true"),
    ],
)
def test_bad_prompt_logprobs_are_a_400_naming_the_field(
    server: OpenAIServer, value: Any, extra: dict[str, Any], says: str
) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w7"}]}),
    ):
        status, got, _ = post(
            server, path, {"model": "tiny", "max_tokens": 1, **body, "prompt_logprobs": value, **extra}
        )
        assert status == 400 and got["error"]["param"] == "prompt_logprobs", got
        assert says in got["error"]["message"], got


# --- against SmolLM2's vocabulary (no model: the parser and the grammar's masks) ----------------------
@pytest.fixture(scope="module")
def smol(smollm2_tokenizer: Any) -> RequestLimits:
    pytest.importorskip("xgrammar")
    return RequestLimits("smol", 49152, 16, 512, ModelText(smollm2_tokenizer, (EOS,), 8192))


SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}


def _allowed(mask: bytes) -> set[int]:
    return {i * 8 + b for i, byte in enumerate(mask) for b in range(8) if byte >> b & 1}


def test_a_json_schema_without_strict_is_enforced_on_completions_too(
    smol: RequestLimits, smollm2_tokenizer: Any
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}  # no "strict"
    for parsed in (
        parse_completion({"prompt": "Age?", "response_format": fmt}, smol),
        parse_chat({"messages": [{"role": "user", "content": "Age?"}], "response_format": fmt}, smol),
    ):
        m = parsed.sampling.grammar.matcher()
        for t in smollm2_tokenizer.encode('{"age": ', add_special_tokens=False):
            assert t in _allowed(m.mask())
            assert m.accept(t)
        for wrong in ('"', "true", "x"):
            t = smollm2_tokenizer.encode(wrong, add_special_tokens=False)[0]
            assert t not in _allowed(m.mask()), wrong


def test_tokenize_returns_bos_by_default_and_drops_it_without_special_tokens(tmp_path: pathlib.Path) -> None:
    from pagedkv.frontend.serve.text import load_model_text
    from tests.frontend.serve_fixtures import save_tokenizer

    save_tokenizer(tmp_path)
    text = load_model_text(str(tmp_path))
    text.tokenizer._place_bos_eos(True, False)  # a tokenizer that puts BOS before a text
    limits = RequestLimits("tiny", 128, 4, 64, text)
    assert tokenize({"prompt": "w7 w8"}, limits)["tokens"] == [1, 7, 8]
    assert tokenize({"prompt": "w7 w8", "add_special_tokens": False}, limits)["tokens"] == [7, 8]
