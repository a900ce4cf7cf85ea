"""vLLM's use_beam_search over HTTP against a served tiny model (its word tokenizer): the n choices
are transformers' n best beams on the same weights, best first, on /v1/completions and on chat; a
stream carries the same tokens; logprobs come with them; what beam search cannot honour is 400
naming the field; and the block manager holds nothing once the requests are over."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.frontend.serve.server import OpenAIServer
from tests.frontend.serve_fixtures import model_with_tokenizer, serving, stack_config
from tests.worker_svc.conftest import HFModel

PROMPT = [7, 8, 9, 31, 12, 45, 16]


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return model_with_tokenizer(tmp_path_factory.mktemp("beam-serve-model"))


@pytest.fixture(scope="module")
def stack(hf: HFModel) -> Iterator[LocalStack]:
    with LocalStack(stack_config(hf, num_gpu_blocks=96)) as st:
        yield st


@pytest.fixture(scope="module")
def server(hf: HFModel, stack: LocalStack) -> Iterator[OpenAIServer]:
    with serving(stack, model=str(hf.path), model_name="tiny") as srv:
        yield srv


def post(server: OpenAIServer, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read().decode()
            if body.get("stream"):
                return r.status, [json.loads(x[6:]) for x in raw.split("\n\n") if x.startswith("data: {")]
            return r.status, json.loads(raw)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def ends(server: OpenAIServer) -> list[int]:
    return list(server.state.limits.text.eos_token_ids)


def idle(stack: LocalStack, timeout_s: float = 10.0) -> tuple[int, int]:
    """(sequences, used blocks) in the block manager, once the engine freed what it held."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stack.block_manager.servicer._core.stats()  # noqa: SLF001 - white-box check
        if (s.num_sequences, s.num_used_blocks) == (0, 0) or time.monotonic() > deadline:
            return s.num_sequences, s.num_used_blocks
        time.sleep(0.05)


@pytest.mark.parametrize("n", [2, 4])
def test_completions_return_transformers_beams_best_first(
    server: OpenAIServer, stack: LocalStack, hf: HFModel, n: int
) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "n": n, "use_beam_search": True}
    status, r = post(server, "/v1/completions", {**body, "length_penalty": 0.5, "temperature": 0.7})
    assert status == 200, r
    want = hf.beam_search(PROMPT, n, 8, ends(server), length_penalty=0.5)
    assert [c["index"] for c in r["choices"]] == list(range(n))
    assert [c["token_ids"] for c in r["choices"]] == [t for t, _ in want]
    for c, (tokens, _) in zip(r["choices"], want, strict=True):
        assert c["finish_reason"] == ("stop" if tokens[-1] in ends(server) else "length")
        assert c["text"] == server.state.limits.text.decode(tokens)
    assert r["usage"]["completion_tokens"] == sum(len(t) for t, _ in want)
    # A stream carries the same tokens, each choice's last chunk with its finish_reason.
    status, chunks = post(server, "/v1/completions", {**body, "length_penalty": 0.5, "stream": True})
    assert status == 200
    streamed: dict[int, list[int]] = {i: [] for i in range(n)}
    reasons: dict[int, str] = {}
    for ch in chunks:
        for c in ch["choices"]:
            streamed[c["index"]] += c["token_ids"]
            if c["finish_reason"]:
                reasons[c["index"]] = c["finish_reason"]
    assert [streamed[i] for i in range(n)] == [c["token_ids"] for c in r["choices"]]
    assert [reasons[i] for i in range(n)] == [c["finish_reason"] for c in r["choices"]]
    assert idle(stack) == (0, 0)


def test_chat_and_logprobs(server: OpenAIServer, stack: LocalStack, hf: HFModel) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "w7 w8 w9"}],
        "max_tokens": 6,
        "n": 2,
        "use_beam_search": True,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 3,
    }
    status, r = post(server, "/v1/chat/completions", body)
    assert status == 200, r
    want = hf.beam_search(r["prompt_token_ids"], 2, 6, ends(server))
    assert [c["token_ids"] for c in r["choices"]] == [t for t, _ in want]
    for c, (tokens, score) in zip(r["choices"], want, strict=True):
        content = c["logprobs"]["content"]
        assert len(content) == len(tokens) and all(len(x["top_logprobs"]) == 3 for x in content)
        total = sum(x["logprob"] for x in content)  # transformers' score: the sum over the length
        assert total / len(tokens) == pytest.approx(score, abs=1e-4)
    assert idle(stack) == (0, 0)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"length_penalty": 0.8, "use_beam_search": False}, "length_penalty"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"9": 2.0}}, "logit_bias"),
        ({"stop": ["w9"]}, "stop"),
        ({"allowed_token_ids": [7, 8]}, "allowed_token_ids"),
        ({"structured_outputs": {"choice": ["w7", "w8"]}}, "structured_outputs"),
        ({"n": 11}, "n"),
    ],
)
def test_what_beam_search_cannot_honour_is_refused(
    server: OpenAIServer, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, **extra}
    status, r = post(server, "/v1/completions", body)
    assert status == 400 and r["error"]["param"] == param, r
    assert r["error"]["message"].startswith(f"{param}: ")


def test_a_client_gone_mid_search_leaves_no_block(server: OpenAIServer, stack: LocalStack) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 60,
        "n": 4,
        "use_beam_search": True,
        "ignore_eos": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    time.sleep(0.3)
    conn.close()  # the server aborts the search at once
    assert idle(stack, 30.0) == (0, 0)
    status, r = post(server, "/v1/completions", {**body, "max_tokens": 3})  # and serves the next one
    assert status == 200 and len(r["choices"]) == 4
