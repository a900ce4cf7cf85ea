"""The fused layer operations (kernels/cpu/csrc/layer_ops.c) against the torch composition they replace
(worker_svc/model/layer_ops.py), on fresh random inputs, with poisoned outputs and caches."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels.cpu import layer_ops as cpu_layer_ops
from pagedkv.worker_svc.model import layer_ops
from pagedkv.worker_svc.model.config import RopeConfig
from pagedkv.worker_svc.model.layer_ops import LayerOps, split_qkv, torch_rms_norm
from pagedkv.worker_svc.model.rope import apply_rotary, cos_sin, inverse_frequencies
from pagedkv.worker_svc.model_runner import SequenceRequest
from tests.worker_svc.conftest import HFModel
from tests.worker_svc.test_model_runner import make_runner

pytestmark = pytest.mark.skipif(not cpu_layer_ops.available(), reason="native kernels not built")
# Without the library every test here is skipped; the unbound stand-in keeps the name typed.
KERNELS = cpu_layer_ops.load() or cpu_layer_ops.LayerKernels(lib=None)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(("n", "h"), [(1, 64), (7, 576), (33, 1024), (300, 576)])
def test_rms_norm_with_and_without_the_residual_add(n: int, h: int) -> None:
    g = _gen(n * h)
    x = torch.randn(n, h, generator=g) * 3
    delta = torch.randn(n, h, generator=g)
    w = 1 + 0.1 * torch.randn(h, generator=g)
    want = torch_rms_norm(x, w, 1e-5)
    torch.testing.assert_close(KERNELS.rms_norm(x.clone(), w, 1e-5), want, rtol=2e-6, atol=2e-6)

    fused_x, ref_x = x.clone(), x.clone()
    got = KERNELS.rms_norm(fused_x, w, 1e-5, delta)
    ref = LayerOps(kernels=None).rms_norm(ref_x, w, 1e-5, delta)
    assert torch.equal(fused_x, x + delta)  # the residual add is exact and in place
    assert torch.equal(ref_x, fused_x)
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)


def test_rms_norm_reads_strided_rows() -> None:
    g = _gen(1)
    base = torch.randn(9, 700, generator=g)
    x = base[:, 50:626]  # rows 700 apart, 576 wide
    w = torch.randn(576, generator=g)
    torch.testing.assert_close(KERNELS.rms_norm(x, w, 1e-6), torch_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize(("n", "inter"), [(1, 8), (5, 1536), (64, 2816)])
def test_silu_mul(n: int, inter: int) -> None:
    gate_up = torch.randn(n, 2 * inter, generator=_gen(n)) * 6  # both signs, well into the tails
    got = KERNELS.silu_mul(gate_up)
    torch.testing.assert_close(got, LayerOps(kernels=None).silu_mul(gate_up), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("n", "inter"), [(1, 8), (5, 1536), (64, 2816)])
def test_gelu_tanh_mul(n: int, inter: int) -> None:
    """``g * sigmoid(2u)``, u = sqrt(2 / pi) (g + 0.044715 g^3) (transformers' gelu_pytorch_tanh,
    ``0.5 g (1 + tanh(u))``), within 5e-7 of float64 relative to each value given u's fp32 rounding
    (which alone moves a value far in the negative tail by up to 2|u| ulp), both tails included;
    torch's ``gelu`` with ``approximate="tanh"`` within its own cancellation for negative g."""
    gate_up = torch.randn(n, 2 * inter, generator=_gen(n)) * 6
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 40.0, -40.0, 3e3, -3e3])
    got = KERNELS.gelu_tanh_mul(gate_up)
    torch.testing.assert_close(got, LayerOps(kernels=None).gelu_tanh_mul(gate_up), rtol=1e-5, atol=1e-5)
    g, up = gate_up.chunk(2, dim=-1)
    u = 0.7978845608028654 * (g + 0.044715 * (g * g * g))  # in fp32, as the kernel rounds it
    want = g.double() * torch.sigmoid(2 * u.double()) * up.double()
    rel = (got.double() - want).abs() / want.abs()
    assert float(rel[want.abs() > 1e-30].max()) < 5e-7


def _rope_case(n: int, heads: int, kv_heads: int, d: int, seed: int):  # type: ignore[no-untyped-def]
    g = _gen(seed)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g)
    positions = torch.randint(0, 4000, (n,), generator=g)
    cos, sin = cos_sin(positions, inverse_frequencies(RopeConfig(theta=100_000.0), d), torch.float32)
    blocks, bs = 12, 16
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    return qkv, cos, sin, slots, blocks, bs


@pytest.mark.parametrize(("n", "heads", "kv_heads", "d"), [(1, 4, 2, 64), (37, 9, 3, 64), (20, 8, 2, 128)])
def test_rope_store_equals_rotary_then_cache_write(n: int, heads: int, kv_heads: int, d: int) -> None:
    qkv, cos, sin, slots, blocks, bs = _rope_case(n, heads, kv_heads, d, seed=n)
    slots[::5] = -1  # skipped tokens write nothing
    kc = torch.full((blocks, bs, kv_heads, d), float("nan"))
    vc = torch.full((blocks, bs, kv_heads, d), float("nan"))
    q = KERNELS.rope_store(qkv, cos, sin, heads, kv_heads, kc, vc, slots)

    q_ref, k_ref, v_ref = split_qkv(qkv, heads, kv_heads, d)
    # fp-contract is off in the C file: the rotation is torch's arithmetic to the bit
    assert torch.equal(q, apply_rotary(q_ref, cos, sin))
    k_rot = apply_rotary(k_ref, cos, sin)
    flat_k, flat_v = kc.view(-1, kv_heads, d), vc.view(-1, kv_heads, d)
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], k_rot[keep])
    assert torch.equal(flat_v[slots[keep]], v_ref[keep])
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


@pytest.mark.parametrize("norms", ["both", "q", "k"])
@pytest.mark.parametrize(("n", "heads", "kv_heads", "d"), [(1, 4, 1, 256), (13, 8, 2, 128)])
def test_rope_store_with_per_head_q_k_norms(n: int, heads: int, kv_heads: int, d: int, norms: str) -> None:
    """Each q / k head RMS-normalised (``torch_rms_norm``, Qwen3's and Gemma 3's per-head norm) before
    its rotation, within fp32 rounding of the norm's sum; a head without a weight as without norms."""
    qkv, cos, sin, slots, blocks, bs = _rope_case(n, heads, kv_heads, d, seed=n + d)
    qkv *= 4
    g = _gen(d)
    q_norm = 1 + 0.3 * torch.randn(d, generator=g) if norms != "k" else None
    k_norm = 1 + 0.3 * torch.randn(d, generator=g) if norms != "q" else None
    kc = torch.full((blocks, bs, kv_heads, d), float("nan"))
    vc = torch.full((blocks, bs, kv_heads, d), float("nan"))
    q = KERNELS.rope_store(qkv, cos, sin, heads, kv_heads, kc, vc, slots, q_norm, k_norm, 1e-6)

    q_ref, k_ref, v_ref = split_qkv(qkv, heads, kv_heads, d)
    if q_norm is not None:
        q_ref = torch_rms_norm(q_ref, q_norm, 1e-6)
    if k_norm is not None:
        k_ref = torch_rms_norm(k_ref, k_norm, 1e-6)
    tol = {"rtol": 2e-6, "atol": 2e-6}
    torch.testing.assert_close(q, apply_rotary(q_ref, cos, sin), **tol)
    torch.testing.assert_close(kc.view(-1, kv_heads, d)[slots], apply_rotary(k_ref, cos, sin), **tol)
    assert torch.equal(vc.view(-1, kv_heads, d)[slots], v_ref)
    if q_norm is None:  # no norm: the plain rotation, to the bit
        assert torch.equal(q, apply_rotary(q_ref, cos, sin))
    plain = LayerOps(kernels=None)  # the torch path of the same call
    step = kernels.prepare_step(
        torch.zeros((1, 2, blocks, bs, kv_heads, d)), heads, 1.0, slots, 0, decode=_one_token_each(n, bs)
    )
    kc2, vc2 = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    q2 = plain.rope_store(qkv, cos, sin, heads, kv_heads, d, kc2, vc2, step, q_norm, k_norm, 1e-6)
    torch.testing.assert_close(q, q2, **tol)
    torch.testing.assert_close(kc.nan_to_num(), kc2.nan_to_num(), **tol)


def _one_token_each(n: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode metadata of n one-token sequences (what prepare_step needs beside the slots)."""
    return torch.zeros((n, 1), dtype=torch.int32), torch.ones(n, dtype=torch.int32)


def test_rope_store_into_a_layer_of_the_all_layers_cache() -> None:
    """The worker hands one layer's views of ``[layers, 2, blocks, bs, kv_heads, d]``: strided."""
    n, heads, kv_heads, d = 11, 9, 3, 64
    qkv, cos, sin, slots, blocks, bs = _rope_case(n, heads, kv_heads, d, seed=3)
    cache = torch.full((3, 2, blocks, bs, kv_heads, d), float("nan"))
    KERNELS.rope_store(qkv, cos, sin, heads, kv_heads, cache[1, 0], cache[1, 1], slots)
    _, k_ref, v_ref = split_qkv(qkv, heads, kv_heads, d)
    assert torch.equal(cache[1, 0].reshape(-1, kv_heads, d)[slots], apply_rotary(k_ref, cos, sin))
    assert torch.equal(cache[1, 1].reshape(-1, kv_heads, d)[slots], v_ref)
    assert cache[0].isnan().all() and cache[2].isnan().all()


def test_bad_arguments_raise_and_write_nothing() -> None:
    x = torch.randn(4, 64)
    before = x.clone()
    with pytest.raises(ValueError, match="weight"):
        KERNELS.rms_norm(x, torch.ones(63), 1e-6, torch.ones(4, 64))
    assert torch.equal(x, before)
    with pytest.raises(ValueError, match="x must be a 2-D fp32"):
        KERNELS.rms_norm(x.to(torch.float64), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="delta has 3 rows"):
        KERNELS.rms_norm(x, torch.ones(64), 1e-6, torch.ones(3, 64))
    with pytest.raises(ValueError, match="even number"):
        KERNELS.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="gate_up must be a 2-D fp32"):
        KERNELS.silu_mul(torch.randn(2, 8)[:, ::2])
    qkv, cos, sin, slots, blocks, bs = _rope_case(5, 4, 2, 64, seed=5)
    kc, vc = torch.zeros(blocks, bs, 2, 64), torch.zeros(blocks, bs, 2, 64)
    with pytest.raises(ValueError, match="need 576"):
        KERNELS.rope_store(qkv, cos, sin, 5, 2, kc, vc, slots)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        KERNELS.rope_store(qkv, cos, sin, 4, 2, kc, vc, slots.to(torch.int32))
    with pytest.raises(ValueError, match="cos/sin"):
        KERNELS.rope_store(qkv, cos[:4], sin[:4], 4, 2, kc, vc, slots)
    with pytest.raises(ValueError, match=r"k_norm must be a dense fp32 CPU tensor of shape \(64,\)"):
        KERNELS.rope_store(qkv, cos, sin, 4, 2, kc, vc, slots, torch.ones(64), torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="q_norm must be"):
        KERNELS.rope_store(qkv, cos, sin, 4, 2, kc, vc, slots, torch.ones(64, dtype=torch.float64))
    assert not kc.any() and not vc.any()


def _spy_on(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> list[str]:
    """The names of the fused kernels called from now on, in call order."""
    calls: list[str] = []
    for name in names:
        real = getattr(cpu_layer_ops.LayerKernels, name)

        def spy(*a, _real=real, _name=name, **kw):  # type: ignore[no-untyped-def]
            calls.append(_name)
            return _real(*a, **kw)

        monkeypatch.setattr(cpu_layer_ops.LayerKernels, name, spy)
    return calls


def _assert_torch_path_agrees(
    runner: Any, seqs: list[SequenceRequest], fused: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same step on the torch composition gives the fused step's logits to fp32 rounding."""
    monkeypatch.setattr(layer_ops, "choose", lambda x, step: LayerOps(kernels=None))
    plain = runner.step(seqs).outputs
    for f, p in zip(fused, plain, strict=True):
        assert f.logits is not None and p.logits is not None
        torch.testing.assert_close(f.logits, p.logits, rtol=1e-4, atol=1e-4)
        assert f.token_id == p.token_id


def test_the_model_runs_fused_on_the_cpu_backend_with_the_torch_paths_logits(
    hf_llama: HFModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mixed prefill + decode step: fused (the default on the CPU backend in fp32) and the torch
    composition give the same logits to fp32 rounding; the fused kernels really ran."""
    runner = make_runner(hf_llama.path, num_gpu_blocks=32)
    seqs = [
        SequenceRequest("a", list(range(3, 40)), list(range(10)), 0, return_logits=True),
        SequenceRequest("b", [7], list(range(10, 16)), 20, return_logits=True),
    ]
    calls = _spy_on(monkeypatch, ("rms_norm", "silu_mul", "rope_store"))
    with kernels.use_backend("cpu"):
        fused = runner.step(seqs).outputs
        layers = runner.model.cfg.num_layers
        assert sorted(set(calls)) == ["rms_norm", "rope_store", "silu_mul"]
        assert calls.count("rope_store") == layers and calls.count("rms_norm") == 2 * layers + 1
        _assert_torch_path_agrees(runner, seqs, fused, monkeypatch)


def test_gemma3_runs_fused_on_the_cpu_backend_with_the_torch_paths_logits(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3's per-call path (a mixed prefill + decode step: not the decode chain) runs the fused
    per-head q/k norm with the rotary embedding and GELU-tanh-and-multiply in every layer, and gives
    the torch composition's logits to fp32 rounding."""
    from tests.worker_svc.model.test_gemma3 import HF_LAYOUT, build_gemma3

    hf = build_gemma3(tmp_path / "hf", seed=4, **HF_LAYOUT)
    runner = make_runner(hf.path, num_gpu_blocks=32)
    seqs = [
        SequenceRequest("a", list(range(3, 22)), list(range(10)), 0, return_logits=True),
        SequenceRequest("b", [7], list(range(10, 16)), 13, return_logits=True),
    ]
    calls = _spy_on(monkeypatch, ("gelu_tanh_mul", "rope_store", "silu_mul"))
    with kernels.use_backend("cpu"):
        fused = runner.step(seqs).outputs
        layers = runner.model.cfg.num_layers
        assert calls.count("rope_store") == layers and calls.count("gelu_tanh_mul") == layers
        assert "silu_mul" not in calls
        _assert_torch_path_agrees(runner, seqs, fused, monkeypatch)
