"""The decode chain (kernels/cpu/decode_layers.py, csrc/decode_layers.c): a decode step's layers in
one native call give the per-call path's results to the bit, on every weight form the native
kernels take (packed fp32, int4 groups with an int8 output layer, K-quant blocks, int4 with
biases), at one and at several sequences whose contexts cross blocks; the cache holds the same
K/V after; the chain really ran; and the steps it does not take (a prefill, Qwen3's q/k norms, an
8-bit cache, shared prefixes planned for the cascade) keep the per-call path."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kernels.cpu.decode_layers import DecodeChain
from pagedkv.worker_svc.model.config import load_model_config
from pagedkv.worker_svc.model.linear import Linear
from pagedkv.worker_svc.model.llama import LlamaModel
from pagedkv.worker_svc.model.weights import load_model
from pagedkv.worker_svc.model_runner import ModelRunner, SequenceRequest
from tests.worker_svc.families import build, small_q4_1_llama, small_q4_k_m_llama

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built")
# The test models are written with transformers and the gguf package (tests/worker_svc/families.py),
# which the GPU image's kernel run (bench/gpu_check.sh) does not install.
pytest.importorskip("transformers")
pytest.importorskip("gguf")

BLOCK, BLOCKS_PER_SEQ = 4, 12
CPU = torch.device("cpu")


def _model(form: str, tmp_path: pathlib.Path) -> LlamaModel:
    if form == "q4_1":
        _, path = small_q4_1_llama(tmp_path, 4)
        held = "file"
    elif form == "q4_k_m":
        _, path = small_q4_k_m_llama(tmp_path, 5)
        held = "file"
    else:  # an HF directory: fp32 packed, or Qwen2 (q/k/v biases) quantized to int4 at load
        arch = "Qwen2ForCausalLM" if form == "qwen2_int4" else "LlamaForCausalLM"
        path = build(arch, tmp_path / "hf", seed=6).path
        held = "int4" if form == "qwen2_int4" else "dense"
    model = load_model(str(path), load_model_config(str(path)), torch.float32, CPU, held=held)
    assert isinstance(model, LlamaModel)
    g = torch.Generator().manual_seed(1)
    for layer in model.layers:  # random norms (they start at 1): a norm read in the wrong place shows
        for norm in (layer.input_norm, layer.post_norm):
            norm.copy_(1 + 0.5 * torch.randn(norm.shape, generator=g))
    return model


def _generate(
    model: LlamaModel,
    prompts: list[list[int]],
    steps: int,
    chain: bool,
    kv_dtype: torch.dtype = torch.float32,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill ``prompts`` in one step, then ``steps`` greedy decode steps of all of them: each
    step's logits, and the cache after."""
    model.chain_decode = chain
    cfg = model.cfg
    row = cfg.head_dim + (cpu_native.SCALE_BYTES if kv_dtype is torch.int8 else 0)  # + an int8 row's scale
    shape = (cfg.num_layers, 2, BLOCKS_PER_SEQ * len(prompts), BLOCK, cfg.num_kv_heads, row)
    cache = torch.zeros(shape, dtype=kv_dtype)
    runner = ModelRunner(model, cache, torch.zeros((*shape[:2], 1, *shape[3:]), dtype=kv_dtype))
    tables = [list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i in range(len(prompts))]
    reqs = [SequenceRequest(f"s{i}", p, tables[i], 0, return_logits=True) for i, p in enumerate(prompts)]
    lens = [len(p) for p in prompts]
    logits = []
    with kernels.use_backend("cpu"):
        for _ in range(steps + 1):
            outs = runner.step(reqs).outputs
            logits.append(torch.stack([o.logits for o in outs if o.logits is not None]))
            reqs = [
                SequenceRequest(f"s{i}", [o.token_id], tables[i], lens[i], return_logits=True)
                for i, o in enumerate(outs)
            ]
            lens = [n + 1 for n in lens]
    return logits, cache


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many sequences each decode-chain call took, call by call."""
    seen: list[int] = []
    real = DecodeChain.__call__

    def spy(self: DecodeChain, x: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append(x.shape[0])
        return real(self, x, *args)

    monkeypatch.setattr(DecodeChain, "__call__", spy)
    return seen


PROMPTS = [[5, 17, 99, 3, 64, 12, 7], [88, 41, 2], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]


@pytest.mark.parametrize("form", ["q4_1", "q4_k_m", "dense", "qwen2_int4"])
@pytest.mark.parametrize("seqs", [1, 3])
def test_the_chain_gives_the_per_call_paths_results_to_the_bit(
    form: str, seqs: int, calls: list[int], tmp_path: pathlib.Path
) -> None:
    model = _model(form, tmp_path)
    assert model.decode_chain() is not None
    steps = 9  # the contexts cross 1-3 blocks of 4
    want, want_cache = _generate(model, PROMPTS[:seqs], steps, chain=False)
    assert calls == []
    got, got_cache = _generate(model, PROMPTS[:seqs], steps, chain=True)
    assert calls == [seqs] * steps  # every decode step, never the prefill
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got_cache, want_cache)
    assert all(torch.isfinite(t).all() for t in got)


def test_qwen3_q_k_norms_keep_the_per_call_path(tmp_path: pathlib.Path) -> None:
    path = build("Qwen3ForCausalLM", tmp_path / "hf", seed=2).path
    model = load_model(str(path), load_model_config(str(path)), torch.float32, CPU, held="dense")
    assert isinstance(model, LlamaModel) and model.decode_chain() is None


def test_an_8_bit_cache_keeps_the_per_call_path(calls: list[int], tmp_path: pathlib.Path) -> None:
    model = _model("q4_1", tmp_path)
    logits, _ = _generate(model, PROMPTS[:2], 3, chain=True, kv_dtype=torch.int8)
    assert calls == [] and all(torch.isfinite(t).all() for t in logits)


def test_shared_prefixes_planned_for_the_cascade_keep_the_per_call_path(
    calls: list[int], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequences whose block tables share leading blocks, with the cascade's threshold lowered so
    that this small step plans it: the chain does not take the step (it has no cascade)."""
    from pagedkv.kernels.cpu import attention as cpu

    monkeypatch.setattr(cpu, "NATIVE_CASCADE_MIN_SAVED_TOKENS", 1)
    monkeypatch.setattr(cpu, "CASCADE_MIN_SAVED_TOKENS", 1)
    model = _model("dense", tmp_path)
    cfg = model.cfg
    shape = (cfg.num_layers, 2, 16, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    runner = ModelRunner(model, torch.zeros(shape), torch.zeros((*shape[:2], 1, *shape[3:])))
    shared = cpu.MIN_SHARED_BLOCKS + 1
    prompt = list(range(3, 3 + shared * BLOCK))  # whole blocks, shared by both sequences
    a, b = list(range(shared + 1)), [*range(shared), shared + 1]
    with kernels.use_backend("cpu"):
        runner.step([SequenceRequest("a", prompt, a, 0)])
        outs = runner.step(
            [SequenceRequest("a", [7], a, len(prompt)), SequenceRequest("b", [8], b, len(prompt))]
        ).outputs
        plan = cpu.plan_decode(torch.tensor([a, b]), torch.tensor([len(prompt) + 1] * 2), BLOCK)
    assert plan.cascade is not None  # the step was planned for the cascade
    assert calls == [] and len(outs) == 2


def test_a_replaced_projection_rebuilds_the_chain(tmp_path: pathlib.Path) -> None:
    """Benchmarks and tests swap a layer's projections for another path: the chain follows (here it
    no longer applies: PyTorch's int4 operator is not a native kernel)."""
    model = _model("q4_1", tmp_path)
    first = model.decode_chain()
    assert first is not None and model.decode_chain() is first
    lin = model.layers[0].o
    assert lin.quantized is not None
    model.layers[0].o = Linear.build(lin.quantized, lin.bias, native=False)
    assert model.decode_chain() is None
    model.layers[0].o = lin
    assert model.decode_chain() is not None
