"""The fused layer operations (kernels/cpu/csrc/layer_ops.c) against the torch composition they replace
(worker_svc/model/layer_ops.py), on fresh random inputs, with poisoned outputs and caches."""

from __future__ import annotations

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
    assert not kc.any() and not vc.any()


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
    calls: list[str] = []
    for name in ("rms_norm", "silu_mul", "rope_store"):
        real = getattr(cpu_layer_ops.LayerKernels, name)

        def spy(*a, _real=real, _name=name, **kw):  # type: ignore[no-untyped-def]
            calls.append(_name)
            return _real(*a, **kw)

        monkeypatch.setattr(cpu_layer_ops.LayerKernels, name, spy)
    with kernels.use_backend("cpu"):
        fused = runner.step(seqs).outputs
        layers = runner.model.cfg.num_layers
        assert sorted(set(calls)) == ["rms_norm", "rope_store", "silu_mul"]
        assert calls.count("rope_store") == layers and calls.count("rms_norm") == 2 * layers + 1
        monkeypatch.setattr(layer_ops, "choose", lambda x, step: LayerOps(kernels=None))
        plain = runner.step(seqs).outputs
    for f, p in zip(fused, plain, strict=True):
        assert f.logits is not None and p.logits is not None
        torch.testing.assert_close(f.logits, p.logits, rtol=1e-4, atol=1e-4)
        assert f.token_id == p.token_id
