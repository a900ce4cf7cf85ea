"""The 8-bit KV cache (kernels/quant.py) against a float64 oracle on the dequantized values.

The CPU-side backends that read 8-bit caches (the torch reference; the CPU backend: native C kernels
for int8, the dequantizing fallback otherwise; the Triton kernels are held to the same oracle in
test_quant_kv_triton.py) on fresh random inputs whose tokens differ in magnitude (so a
scale read from the wrong token or head is a visible error), shuffled block tables, odd lengths, NaN
in the output before the call and NaN scales in every slot no sequence owns. The oracle is plain
float64 attention over ``values * scales`` gathered one token at a time; the mutation tests show that
a kernel reading a neighbouring row's scale is far outside the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels import quant, reference
from pagedkv.kernels.cpu import attention as cpu
from pagedkv.kernels.cpu import native as cpu_native
from tests.kernels.quant_cases import CASES, DTYPES, oracle, q_lens_of
from tests.kernels.quant_cases import batch as _batch
from tests.kernels.quant_cases import decode as _decode
from tests.kernels.quant_cases import prefill as _prefill
from tests.kernels.quant_cases import tables_tensor as _tables_tensor

BACKENDS = ["reference", "cpu"]
TOL = 5e-4  # fp32 kernels against the float64 oracle on the same dequantized values (|v| up to ~80)


@pytest.mark.parametrize("kv", list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_decode_matches_the_float64_oracle(kv: str, backend: str, case: int, variant: str) -> None:
    """(``variant``: the native int8 path in each build's key batches.)"""
    heads, kvh, d, bs, lens = CASES[case]
    kc, vc, tables = _batch(case, kv, lens, heads, kvh, d, bs)
    q = torch.randn(len(lens), heads, d, generator=torch.Generator().manual_seed(100 + case))
    want = oracle(q, kc, vc, tables, lens, [1] * len(lens), d**-0.5)
    got = _decode(backend, q, kc, vc, tables, lens, d**-0.5)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("kv", list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_prefill_matches_the_float64_oracle(kv: str, backend: str, case: int, variant: str) -> None:
    """(``variant``: the native int8 path in each build's register tiles.)"""
    heads, kvh, d, bs, lens = CASES[case]
    q_lens = q_lens_of(lens)  # whole prompts and chunks after a hit
    kc, vc, tables = _batch(case, kv, lens, heads, kvh, d, bs)
    q = torch.randn(sum(q_lens), heads, d, generator=torch.Generator().manual_seed(200 + case))
    want = oracle(q, kc, vc, tables, lens, q_lens, d**-0.5)
    got = _prefill(backend, q, kc, vc, tables, lens, q_lens, d**-0.5)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, atol=TOL, rtol=TOL)


@pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built")
def test_the_native_kernels_take_int8_caches() -> None:
    """The CPU backend runs int8 on the C kernels (not the dequantizing fallback)."""
    kc, _, _ = _batch(0, "int8", [5], 9, 3, 64, 16)
    assert cpu_native.supports(torch.zeros(1, 9, 64), kc, kc)
    assert cpu_native.prefill_supports(torch.zeros(1, 9, 64), kc, kc)
    assert not cpu_native.supports(torch.zeros(1, 9, 64, dtype=torch.bfloat16), kc, kc)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_hits_read_the_shared_quantized_blocks_as_they_are(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight sequences whose tables start with the same four blocks (prefix-cache hits): decode reads
    the shared rows and scales unchanged; on the CPU backend through the native cascade."""
    monkeypatch.setattr(cpu, "NATIVE_CASCADE_MIN_SAVED_TOKENS", 1)
    lens = [64 + n for n in (1, 7, 16, 30, 3, 19, 33, 2)]
    kc, vc, tables = _batch(7, "int8", lens, 9, 3, 64, 16, shared=4)
    assert all(t[:4] == tables[0][:4] for t in tables)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(7))
    if backend == "cpu" and cpu_native.available():
        plan = cpu.plan_decode(_tables_tensor(tables), torch.tensor(lens, dtype=torch.int32), 16)
        assert plan.cascade is not None  # the group takes the cascade
    want = oracle(q, kc, vc, tables, lens, [1] * len(lens), 0.125)
    got = _decode(backend, q, kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(got.double(), want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("roll", [(1, 1), (1, 2)])  # the next slot's scale; the next KV head's
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_wrong_scale_index_turns_the_oracle_red(backend: str, roll: tuple[int, int]) -> None:
    """A kernel that read a neighbouring row's scale would compute on a cache whose scales are shifted
    by one slot or one KV head: the outputs are then far outside the tolerance the tests hold them to."""
    lens = [1, 17, 33, 70, 5]
    kc, vc, tables = _batch(3, "int8", lens, 9, 3, 64, 16)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(3))
    want = oracle(q, kc, vc, tables, lens, [1] * len(lens), 0.125)
    for cache in (kc, vc):
        s = quant.scales(cache)
        s.copy_(s.roll(roll[0], dims=roll[1]).nan_to_num(1.0))
        got = _decode(backend, q, kc, vc, tables, lens, 0.125)
        with pytest.raises(AssertionError):
            torch.testing.assert_close(got.double(), want, atol=TOL, rtol=TOL)
        assert (got.double() - want).abs().max() > 100 * TOL


@pytest.mark.parametrize("kv", list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_write_quantizes_each_row_against_its_own_magnitude(kv: str, backend: str) -> None:
    """Scales are amax / qmax per (token, KV head); values round to nearest (int8: within half a step);
    slot -1 writes nothing and every other slot is untouched; the CPU backend writes the reference's bytes."""
    g = torch.Generator().manual_seed(11)
    dt = DTYPES[kv]
    kc = torch.randint(-127, 128, (6, 8, 2, 36), generator=g).to(torch.int8)
    kc = kc.view(dt) if dt is not torch.int8 else kc
    vc = kc.clone()
    before_k, before_v = kc.clone(), vc.clone()
    mag = torch.rand(9, 2, 1, generator=g) * 10 + 0.01
    k, v = torch.randn(9, 2, 32, generator=g) * mag, torch.randn(9, 2, 32, generator=g) * mag
    k[4] = 0.0  # an all-zero row: scale 0, values 0
    slots = torch.tensor([3, 17, -1, 40, 8, 47, 0, -1, 22])
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        kernels.write_kv_cache(k, v, kc, vc, slots)
    keep = slots >= 0
    b, o = slots[keep] // 8, slots[keep] % 8
    for x, cache in ((k[keep], kc), (v[keep], vc)):
        rows = cache[b, o]
        qmax = quant.QMAX[dt]
        torch.testing.assert_close(quant.scales(rows), x.abs().amax(-1) / qmax, rtol=0, atol=0)
        err = (quant.dequantize(rows) - x).abs()
        step = quant.scales(rows).unsqueeze(-1)
        bound = step * (0.5 if dt is torch.int8 else 16.0) + 1e-6  # e4m3: 3 mantissa bits, 1/16 of 256
        assert bool((err <= bound).all())
    untouched = torch.ones(6, 8, dtype=torch.bool)
    untouched[b, o] = False
    assert torch.equal(kc.view(torch.int8)[untouched], before_k.view(torch.int8)[untouched])
    assert torch.equal(vc.view(torch.int8)[untouched], before_v.view(torch.int8)[untouched])
    ref_k, ref_v = before_k.clone(), before_v.clone()
    reference.write_kv_cache(k, v, ref_k, ref_v, slots)
    assert torch.equal(kc.view(torch.int8), ref_k.view(torch.int8))
    assert torch.equal(vc.view(torch.int8), ref_v.view(torch.int8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_and_swap_move_the_scales_with_their_blocks(backend: str) -> None:
    """Copy-on-write (copy_blocks over all layers) and swap (device <-> host pool) copy whole 8-bit
    blocks: the destination dequantizes to exactly the source, and nothing else changes."""
    layers = [_batch(20 + i, "int8", [40, 9], 9, 3, 64, 16) for i in range(2)]
    kcs, vcs = [x[0] for x in layers], [x[1] for x in layers]
    pairs = torch.tensor([[0, 5], [2, 4]])
    before = [c.clone() for c in kcs + vcs]
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        kernels.copy_blocks(kcs, vcs, pairs)
    for c, old in zip(kcs + vcs, before, strict=True):
        assert torch.equal(c[5], old[0]) and torch.equal(c[4], old[2])
        assert torch.equal(quant.scales(c[5]).nan_to_num(7.0), quant.scales(old[0]).nan_to_num(7.0))
        keep = [i for i in range(c.shape[0]) if i not in (4, 5)]
        assert torch.equal(c[keep], old[keep])
    host = [torch.zeros(8, *c.shape[1:], dtype=torch.int8) for c in kcs + vcs]
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        kernels.swap_blocks(kcs + vcs, host, torch.tensor([[1, 6], [3, 0]]))
    for c, h in zip(kcs + vcs, host, strict=True):
        assert torch.equal(h[6], c[1]) and torch.equal(h[0], c[3])
        assert torch.equal(quant.dequantize(h[6]).nan_to_num(0.5), quant.dequantize(c[1]).nan_to_num(0.5))


def test_8bit_caches_are_checked_by_name() -> None:
    q = torch.zeros(1, 4, 32)
    bad = torch.zeros(4, 8, 2, 34, dtype=torch.int8)  # 30 values + 4: head_dim not a multiple of 4
    with pytest.raises(ValueError, match="head_dim a multiple of 4"):
        kernels.paged_decode_attention(
            q, bad, bad, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0
        )
    other = torch.zeros(4, 8, 2, 32, dtype=torch.int8)  # rows of 28 values + scale: not the query's 32
    with pytest.raises(ValueError, match="query head_dim 32 != cache head_dim 28"):
        kernels.paged_decode_attention(
            q, other, other, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0
        )


@pytest.mark.parametrize("sm", [(9, 0), (8, 0)])
def test_8bit_caches_go_to_triton_on_cuda_and_to_the_native_kernels_on_cpu(
    sm: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto: CUDA 8-bit caches run the Triton kernels (the GPU worker's path, a model step included),
    except fp8_e4m3 below sm_89, where Triton has no e4m3 (the reference then; asking for Triton is
    refused naming the capability); CPU ones take the CPU backend even under TRITON_INTERPRET (its
    native kernels are the CPU's fast path); the interpreter runs them when asked for by name
    (tests/kernels/test_quant_kv_triton.py)."""
    from pagedkv.kernels import dispatch

    monkeypatch.setattr(dispatch, "capability", lambda device: sm)
    cuda = torch.device("cuda")
    for dt in DTYPES.values():
        assert dispatch.resolve(torch.device("cpu"), dt, "auto") == "cpu"
        if not dispatch.triton_available():
            assert dispatch.resolve(cuda, dt, "auto") == "reference"
            continue
        if dt is torch.float8_e4m3fn and sm < (8, 9):
            assert dispatch.resolve(cuda, dt, "auto") == "reference"
            with pytest.raises(RuntimeError, match=r"fp8_e4m3 KV cache on cuda \(compute capability 8.0\)"):
                dispatch.resolve(cuda, dt, "triton")
        else:
            assert dispatch.resolve(cuda, dt, "auto") == "triton"
            assert dispatch.resolve(cuda, dt, "triton") == "triton"
        if dispatch.triton_interpreted():
            assert dispatch.resolve(torch.device("cpu"), dt, "triton") == "triton"
    assert dispatch.resolve(cuda, torch.bfloat16, "auto") == (
        "triton" if dispatch.triton_available() else "reference"
    )
