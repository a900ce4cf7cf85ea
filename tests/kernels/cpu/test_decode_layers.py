"""The decode chain (kernels/cpu/decode_layers.py, csrc/decode_layers.c): a decode step's layers in
one native call give the per-call path's results to the bit, on every weight form the native
kernels take (packed fp32, int4 groups with an int8 output layer, int8 rows, K-quant blocks, int4
with biases), at one and at several sequences whose contexts cross blocks; for Llama's layer, Qwen3's
(per-head q/k norms) and Gemma 3's (four norms, GELU-tanh, q/k norms, local and global rotary
tables, sliding windows shorter than the sequences, and KV-cache groups whose window tables have
released their first blocks); the cache holds the same K/V after; the chain really ran; and the
steps it does not take (a prefill, an 8-bit cache, shared prefixes planned for the cascade) keep the
per-call path."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from pagedkv import kernels
from pagedkv.block_manager_svc.core.kv_groups import ONE_GROUP, KVGroup
from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kernels.cpu.decode_layers import DecodeChain
from pagedkv.worker_svc.model.config import load_model_config
from pagedkv.worker_svc.model.gemma3 import Gemma3Model
from pagedkv.worker_svc.model.kv_layout import kv_layout, model_kv_groups
from pagedkv.worker_svc.model.linear import Linear
from pagedkv.worker_svc.model.llama import LlamaModel
from pagedkv.worker_svc.model.weights import load_model
from pagedkv.worker_svc.model_runner import ModelRunner, SequenceRequest
from tests.worker_svc.families import build, q4_k_m_type, small_q4_1_llama, small_q4_k_m_llama

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
    else:  # an HF directory: fp32 packed, Qwen3 (q/k norms), or Qwen2 (q/k/v biases) quantized to int4
        arch = {"qwen2_int4": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(form, "LlamaForCausalLM")
        path = build(arch, tmp_path / "hf", seed=6).path
        held = "int4" if form == "qwen2_int4" else "dense"
    model = load_model(str(path), load_model_config(str(path)), torch.float32, CPU, held=held)
    assert isinstance(model, LlamaModel)
    g = torch.Generator().manual_seed(1)
    for layer in model.layers:  # random norms (they start at 1): a norm read in the wrong place shows
        for norm in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm):
            if norm is not None:
                norm.copy_(1 + 0.5 * torch.randn(norm.shape, generator=g))
    return model


S, F = "sliding_attention", "full_attention"


def _gemma(form: str, tmp_path: pathlib.Path) -> Gemma3Model:
    """A random Gemma 3 of six layers with a window of 8 (shorter than the sequences here), its
    norm weights random: an HF directory held dense (packed fp32), int4 or int8, or a Q4_K_M-like
    GGUF (Q4_K and Q6_K blocks; 256-wide layers, llama.cpp's layout: the sixth layer global)."""
    from tests.worker_svc.model.test_gemma3 import build_gemma3, write_gemma3_gguf

    if form == "q4_k_m":
        hf = build_gemma3(
            None, seed=7, num_hidden_layers=6, hidden_size=256, intermediate_size=256, head_dim=64
        )
        path = tmp_path / "g.Q4_K_M.gguf"
        write_gemma3_gguf(hf, path, qtype_of=q4_k_m_type)
        held = "file"
    else:
        hf = build_gemma3(
            tmp_path / "hf",
            seed=7,
            num_hidden_layers=6,
            layer_types=[S, S, F, S, S, F],
            query_pre_attn_scalar=24,
        )
        path, held = hf.path, form
    model = load_model(str(path), load_model_config(str(path)), torch.float32, CPU, held=held)
    assert isinstance(model, Gemma3Model)
    want = {"dense": "native", "int4": "native-int4", "int8": "native-int8", "q4_k_m": "native-kquant"}[form]
    assert want in model.layers[0].qkv.path
    return model


def _generate(
    model: LlamaModel,
    prompts: list[list[int]],
    steps: int,
    chain: bool,
    kv_dtype: torch.dtype = torch.float32,
    groups: tuple[KVGroup, ...] = ONE_GROUP,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill ``prompts`` in one step, then ``steps`` greedy decode steps of all of them: each
    step's logits, and the cache after. With KV-cache ``groups``, each group has its own blocks, a
    window group's table starts at its window's first block (the entries before are -1) and the
    blocks it left are set to NaN after each step (nothing may read them)."""
    model.chain_decode = chain
    cfg = model.cfg
    layout = kv_layout(cfg, groups)
    row = cfg.head_dim + (cpu_native.SCALE_BYTES if kv_dtype is torch.int8 else 0)  # + an int8 row's scale
    shape = (
        layout.layers_per_block,
        2,
        BLOCKS_PER_SEQ * len(prompts) * len(groups),
        BLOCK,
        cfg.num_kv_heads,
        row,
    )
    cache = torch.zeros(shape, dtype=kv_dtype)
    runner = ModelRunner(
        model, cache, torch.zeros((*shape[:2], 1, *shape[3:]), dtype=kv_dtype), kv_groups=groups
    )

    def table(g: int, i: int) -> list[int]:
        first = (g * len(prompts) + i) * BLOCKS_PER_SEQ
        return list(range(first, first + BLOCKS_PER_SEQ))

    def request(i: int, tokens: list[int], cached: int) -> SequenceRequest:
        firsts = [groups[g].first_live(cached, BLOCK) for g in range(1, len(groups))]
        return SequenceRequest(
            f"s{i}", tokens, table(0, i), cached, return_logits=True,
            group_tables=[(f, table(g, i)[f:]) for g, f in enumerate(firsts, start=1)],
        )  # fmt: skip

    reqs = [request(i, p, 0) for i, p in enumerate(prompts)]
    lens = [len(p) for p in prompts]
    logits = []
    with kernels.use_backend("cpu"):
        for _ in range(steps + 1):
            outs = runner.step(reqs).outputs
            logits.append(torch.stack([o.logits for o in outs if o.logits is not None]))
            reqs = [request(i, [o.token_id], lens[i]) for i, o in enumerate(outs)]
            for r in reqs:
                for g, (first, _) in enumerate(r.group_tables, start=1):
                    cache[:, :, table(g, int(r.seq_id[1:]))[:first]] = float("nan")
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


def _same(
    got: tuple[list[torch.Tensor], torch.Tensor], want: tuple[list[torch.Tensor], torch.Tensor]
) -> None:
    """Every step's logits and the cache after, to the bit (NaN where blocks were released, in both)."""
    for a, b in zip(got[0], want[0], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got[1].isnan(), want[1].isnan())
    assert torch.equal(got[1].nan_to_num(), want[1].nan_to_num())
    assert all(torch.isfinite(t).all() for t in got[0])


@pytest.mark.parametrize("form", ["q4_1", "q4_k_m", "dense", "qwen2_int4", "qwen3"])
@pytest.mark.parametrize("seqs", [1, 3])
def test_the_chain_gives_the_per_call_paths_results_to_the_bit(
    form: str, seqs: int, calls: list[int], tmp_path: pathlib.Path
) -> None:
    model = _model(form, tmp_path)
    assert model.decode_chain() is not None
    steps = 9  # the contexts cross 1-3 blocks of 4
    want = _generate(model, PROMPTS[:seqs], steps, chain=False)
    assert calls == []
    got = _generate(model, PROMPTS[:seqs], steps, chain=True)
    assert calls == [seqs] * steps  # every decode step, never the prefill
    _same(got, want)


@pytest.mark.parametrize("grouped", [False, True], ids=["flat", "groups"])
@pytest.mark.parametrize(
    ("form", "seqs"), [("dense", 1), ("dense", 3), ("int4", 3), ("int8", 3), ("q4_k_m", 3)]
)
def test_gemma3s_chain_gives_the_per_call_paths_results_to_the_bit(
    form: str, seqs: int, grouped: bool, calls: list[int], tmp_path: pathlib.Path
) -> None:
    """Gemma 3's layers (window 8; the sequences reach 16-20 tokens) in one call, with every layer's
    K/V in one cache (flat) or in the model's KV-cache groups (window layers through their own
    group's tables, slots and cache slots; their first blocks released as the window moves on)."""
    model = _gemma(form, tmp_path)
    groups = model_kv_groups(model.cfg) if grouped else ONE_GROUP
    assert len(groups) == (1 if not grouped else 3 if form != "q4_k_m" else 6)
    steps = 9
    want = _generate(model, PROMPTS[:seqs], steps, chain=False, groups=groups)
    assert calls == []
    got = _generate(model, PROMPTS[:seqs], steps, chain=True, groups=groups)
    assert calls == [seqs] * steps
    _same(got, want)
    if grouped:  # the window groups' tables lost their first blocks (-1) while the chain ran
        assert groups[1].first_live(len(PROMPTS[0]) + steps - 1, BLOCK) >= 2


def test_the_chain_follows_the_kv_layout(tmp_path: pathlib.Path) -> None:
    """Each layer's cache slot and group come from the model's KV layout (set by the model runner):
    a new layout builds a new chain, as a replaced norm weight does (the chain points into them)."""
    model = _gemma("dense", tmp_path)
    flat = model.decode_chain()
    assert flat is not None and model.decode_chain() is flat and flat.cache_slots == model.cfg.num_layers
    model.kv_layout = kv_layout(model.cfg, model_kv_groups(model.cfg))
    grouped = model.decode_chain()
    assert grouped is not None and grouped is not flat and grouped.cache_slots == 2
    assert grouped.tables == [(1, 8), (0, None), (2, 8)]  # (group, window) by first layer
    model.ffn_norms[3] = (model.ffn_norms[3][0].clone(), model.ffn_norms[3][1])  # a replaced norm too
    again = model.decode_chain()
    assert again is not None and again is not grouped and model.decode_chain() is again


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
