"""The Triton kernels on 8-bit KV caches (kernels/quant.py): interpreted on CPU, compiled on a GPU.

The same float64 oracle on the dequantized values as the CPU-side backends (tests/kernels/quant_cases.py):
fresh random inputs whose tokens differ 400x in magnitude, shuffled block tables with garbage padding,
odd lengths, NaN-poisoned outputs and NaN scales in every slot no sequence owns. The write must give
the reference's bytes; copy and swap must move the scales with their blocks; and each way of reading
a wrong scale (one per block, one KV head's for all, K's for V) must turn the oracle red. Shapes stay
small: the interpreter costs a few ms per (program x KV tile). On a GPU (bench/gpu_check.sh's pytest
section runs tests/kernels) the same tests compile the kernels and add bf16 queries.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels import decode, prefill, quant, reference
from tests.kernels import quant_cases as qc
from tests.kernels.cases import DEVICE, HAS_CUDA, cuda_only

pytestmark = pytest.mark.usefixtures("triton_backend")

# fp32 queries: exact dots in the interpreter, tf32x3 on a GPU; half-precision ones run their dots in
# that dtype on a GPU (dequantized V rounded to it). Relative to the largest |output| (about 20 here).
TOL = {torch.float32: 2e-3 if HAS_CUDA else 2e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


# quant_cases.CASES with shorter sequences: the interpreter pays per (program x tile).
CASES = [  # heads, kv_heads, head_dim, block_size, lens
    (9, 3, 64, 16, [1, 17, 33, 5]),  # SmolLM2's group of 3
    (4, 4, 32, 8, [3, 40, 9]),
    (8, 2, 128, 16, [49, 1]),
]
CASE_KV = [(0, "int8"), (0, "fp8_e4m3"), (1, "int8"), (2, "fp8_e4m3")]


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not got.isnan().any(), "output has NaN (an element never written, or a NaN scale read)"
    tol = TOL[dtype] * float(want.abs().max())
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=TOL[dtype])


def _query(rows: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, head_dim, generator=g).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize(("case", "kv"), CASE_KV)
def test_decode_matches_the_float64_oracle(case: int, kv: str) -> None:
    heads, kvh, d, bs, lens = CASES[case]
    kc, vc, tables = qc.batch(case, kv, lens, heads, kvh, d, bs, device=DEVICE)
    q = _query(len(lens), heads, d, torch.float32, 100 + case)
    want = qc.oracle(q, kc, vc, tables, lens, [1] * len(lens), d**-0.5)
    assert_matches(qc.decode("triton", q, kc, vc, tables, lens, d**-0.5), want, torch.float32)


@pytest.mark.parametrize(("case", "kv"), CASE_KV)
def test_prefill_matches_the_float64_oracle(case: int, kv: str) -> None:
    heads, kvh, d, bs, lens = CASES[case]
    q_lens = qc.q_lens_of(lens)
    kc, vc, tables = qc.batch(case, kv, lens, heads, kvh, d, bs, device=DEVICE)
    q = _query(sum(q_lens), heads, d, torch.float32, 200 + case)
    want = qc.oracle(q, kc, vc, tables, lens, q_lens, d**-0.5)
    assert_matches(qc.prefill("triton", q, kc, vc, tables, lens, q_lens, d**-0.5), want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=cuda_only)])
@pytest.mark.parametrize("kv", list(qc.DTYPES))
def test_half_precision_queries(kv: str, dtype: torch.dtype) -> None:
    """The model dtypes a GPU serves in: the cache stays 8-bit, queries and outputs are fp16/bf16."""
    lens = [1, 17, 35]
    kc, vc, tables = qc.batch(5, kv, lens, 8, 2, 64, 16, device=DEVICE)
    q = _query(len(lens), 8, 64, dtype, 5)
    want = qc.oracle(q, kc, vc, tables, lens, [1] * len(lens), 0.125)
    got = qc.decode("triton", q, kc, vc, tables, lens, 0.125)
    assert got.dtype == dtype
    assert_matches(got, want, dtype)
    q_lens = qc.q_lens_of(lens)
    q = _query(sum(q_lens), 8, 64, dtype, 6)
    want = qc.oracle(q, kc, vc, tables, lens, q_lens, 0.125)
    assert_matches(qc.prefill("triton", q, kc, vc, tables, lens, q_lens, 0.125), want, dtype)


@pytest.mark.parametrize("num_splits", [3])
def test_decode_split_kv_with_empty_splits(num_splits: int) -> None:
    """Split-KV's partials and reduce over 8-bit rows; the short sequences leave splits empty."""
    lens = [1, 33, 300]
    kc, vc, tables = qc.batch(9, "int8", lens, 4, 1, 32, 16, device=DEVICE)
    q = _query(len(lens), 4, 32, torch.float32, 9)
    want = qc.oracle(q, kc, vc, tables, lens, [1] * len(lens), 0.2)
    got = qc.decode("triton", q, kc, vc, tables, lens, 0.2, num_splits=num_splits)
    assert_matches(got, want, torch.float32)


def test_prefix_hits_read_the_shared_quantized_blocks_as_they_are() -> None:
    """Sequences whose tables start with the same physical blocks (prefix-cache hits)."""
    lens = [33 + n for n in (1, 16, 7)]
    kc, vc, tables = qc.batch(7, "fp8_e4m3", lens, 6, 2, 32, 16, shared=2, device=DEVICE)
    assert all(t[:2] == tables[0][:2] for t in tables)
    q_lens = [3, 1, 5]
    q = _query(sum(q_lens), 6, 32, torch.float32, 7)
    want = qc.oracle(q, kc, vc, tables, lens, q_lens, 0.2)
    assert_matches(qc.prefill("triton", q, kc, vc, tables, lens, q_lens, 0.2), want, torch.float32)


# A kernel that reads a wrong scale, as the wrapper's scale arguments would make it:
# [k_scales, v_scales, s_ksb, s_kso, s_ksh, s_vsb, s_vso, s_vsh] (pagedkv.kernels.tile.scale_args).
MUTATIONS: dict[str, Callable[[list[object]], list[object]]] = {
    "one scale per block": lambda a: [*a[:3], 0, a[4], a[5], 0, a[7]],
    "KV head 0's scales for every head": lambda a: [*a[:4], 0, a[5], a[6], 0],
    "K's scales for V": lambda a: [a[0], a[0], *a[2:5], *a[2:5]],
}


@pytest.mark.parametrize("op", ["decode", "prefill"])
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_wrong_scale_index_turns_the_oracle_red(
    op: str, mutation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    heads, kvh, d, bs, lens = 4, 2, 32, 8, [19, 6]
    kc, vc, tables = qc.batch(3, "int8", lens, heads, kvh, d, bs, device=DEVICE)
    q_lens = [1, 1] if op == "decode" else qc.q_lens_of(lens)
    q = _query(sum(q_lens), heads, d, torch.float32, 3)
    want = qc.oracle(q, kc, vc, tables, lens, q_lens, d**-0.5)

    def run() -> torch.Tensor:
        if op == "decode":
            return qc.decode("triton", q, kc, vc, tables, lens, d**-0.5)
        return qc.prefill("triton", q, kc, vc, tables, lens, q_lens, d**-0.5)

    assert_matches(run(), want, torch.float32)  # the unmutated kernel is green on these inputs
    module = decode if op == "decode" else prefill
    real = module.scale_args

    def wrong(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[list[object], bool]:
        args, quantized = real(key_cache, value_cache)
        return MUTATIONS[mutation](args), quantized

    monkeypatch.setattr(module, "scale_args", wrong)
    got = run()
    with pytest.raises(AssertionError):
        assert_matches(got, want, torch.float32)
    assert float((got.cpu().double() - want).abs().max()) > 100 * TOL[torch.float32] * float(want.abs().max())


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=cuda_only)]
)
@pytest.mark.parametrize("kv", list(qc.DTYPES))
def test_write_gives_the_reference_bytes(kv: str, dtype: torch.dtype) -> None:
    """Quantize on write into a layer of an all-layers cache from strided K/V (a fused qkv's slices):
    the reference's bytes, slot -1 and every other slot untouched, scales amax / qmax, an all-zero row
    scale 0. Magnitudes from 0.001 to 10 (e4m3 subnormals included), exact ties for int8's rounding."""
    g = torch.Generator().manual_seed(11)
    qdt = qc.DTYPES[kv]
    big = torch.randint(-127, 128, (3, 2, 6, 8, 2, 36), generator=g).to(torch.int8).view(qdt).to(DEVICE)
    kc, vc = big[1, 0], big[1, 1]
    before = big.clone()
    mag = torch.rand(9, 2, 1, generator=g) * 10 + 0.001
    qkv = torch.randn(9, 3, 2, 32, generator=g) * mag.unsqueeze(1)
    qkv[4, 1] = 0.0  # an all-zero key row: scale 0, values 0
    qkv[5, 1, 0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # int8: scale 1, three ties to even
    qkv = qkv.to(dtype=dtype, device=DEVICE)
    k, v = qkv[:, 1], qkv[:, 2]
    assert not k.is_contiguous()
    slots = torch.tensor([3, 17, -1, 40, 8, 47, 0, -1, 22], device=DEVICE)
    kernels.write_kv_cache(k, v, kc, vc, slots)
    want = before.clone()
    reference.write_kv_cache(k, v, want[1, 0], want[1, 1], slots)
    assert torch.equal(big.view(torch.int8), want.view(torch.int8))
    assert not torch.equal(big.view(torch.int8), before.view(torch.int8))
    keep = slots >= 0
    b, o = slots[keep] // 8, slots[keep] % 8
    torch.testing.assert_close(
        quant.scales(kc[b, o]), k[keep].float().abs().amax(-1) / quant.QMAX[qdt], rtol=0, atol=0
    )
    untouched = torch.ones(3, 2, 6, 8, dtype=torch.bool, device=DEVICE)
    untouched[1, :, b, o] = False
    assert torch.equal(big.view(torch.int8)[untouched], before.view(torch.int8)[untouched])


@pytest.mark.parametrize("kv", list(qc.DTYPES))
def test_copy_and_swap_move_the_scales_with_their_blocks(kv: str) -> None:
    """The worker's cache ops on an all-layers 8-bit cache: copy-on-write (``copy_blocks`` over every
    layer's K and V in one launch) and swap out / in through block-major views to a host pool (direct
    runs and the gathered path). Destinations hold the sources' bytes, nothing else changes, and a
    sequence reading the copied block attends exactly as it did over the original."""
    layers, nb, bs, hkv, d = 2, 12, 8, 2, 32
    g = torch.Generator().manual_seed(21)
    qdt = qc.DTYPES[kv]
    gpu = torch.randint(-127, 128, (layers, 2, nb, bs, hkv, d + 4), generator=g).to(torch.int8).view(qdt)
    gpu = gpu.to(DEVICE)
    for layer in range(layers):
        k = torch.randn(nb * bs, hkv, d, generator=g) * (torch.rand(nb * bs, hkv, 1, generator=g) * 20 + 0.05)
        v = torch.randn(nb * bs, hkv, d, generator=g)
        reference.write_kv_cache(
            k.to(DEVICE), v.to(DEVICE), gpu[layer, 0], gpu[layer, 1], torch.arange(nb * bs, device=DEVICE)
        )
    before = gpu.clone()
    pairs = torch.tensor([[0, 5], [2, 4], [7, 11]])
    kernels.copy_blocks([gpu[i, 0] for i in range(layers)], [gpu[i, 1] for i in range(layers)], pairs)
    raw, old = gpu.view(torch.int8), before.view(torch.int8)
    for s, t in pairs.tolist():
        assert torch.equal(raw[:, :, t], old[:, :, s])
        assert torch.equal(quant.scales(gpu[:, :, t]), quant.scales(before[:, :, s]))
    others = [i for i in range(nb) if i not in (5, 4, 11)]
    assert torch.equal(raw[:, :, others], old[:, :, others])

    q = _query(1, 4, d, torch.float32, 21)
    at = qc.decode("triton", q, gpu[1, 0], gpu[1, 1], [[3, 2]], [13], 0.2)  # block 2 ...
    at_copy = qc.decode("triton", q, gpu[1, 0], gpu[1, 1], [[3, 4]], [13], 0.2)  # ... and its copy, 4
    assert torch.equal(at, at_copy)

    host = torch.zeros(layers, 2, 16, bs, hkv, d + 4, dtype=torch.int8).view(qdt)
    major_gpu, major_host = (
        gpu.permute(2, 0, 1, 3, 4, 5),
        host.permute(2, 0, 1, 3, 4, 5),
    )  # the worker's views
    for out_pairs in (
        [[1, 6], [2, 7]],
        [[0, 9], [3, 1], [5, 14], [8, 3], [10, 12], [11, 0]],
    ):  # a run; scattered
        p = torch.tensor(out_pairs)
        kernels.swap_blocks(major_gpu, major_host, p)
        for s, t in out_pairs:
            assert torch.equal(host[:, :, t].view(torch.int8), gpu[:, :, s].cpu().view(torch.int8))
    back = [[9, 6], [1, 7], [14, 8]]  # swap in: host blocks over device blocks
    expect = gpu.clone()
    for s, t in back:
        expect[:, :, t] = host[:, :, s].to(DEVICE)
    kernels.swap_blocks(major_host, major_gpu, torch.tensor(back))
    assert torch.equal(gpu.view(torch.int8), expect.view(torch.int8))
    assert torch.equal(quant.scales(gpu[:, :, 6]), quant.scales(before[:, :, 0]))


def test_a_model_step_runs_the_triton_kernels_on_an_8bit_cache() -> None:
    """The worker's per-step path (``pagedkv.kernels.prepare_step``, what ``AttentionBatch.kernels_step``
    builds): its backend is Triton, and its write + attention of one prefill and one decode sequence
    over an all-layers int8 cache match the oracle."""
    layers, nb, bs, hkv, heads, d = 2, 8, 8, 2, 4, 32
    g = torch.Generator().manual_seed(31)
    cache = torch.zeros(layers, 2, nb, bs, hkv, d + 4, dtype=torch.int8, device=DEVICE)
    quant.scales(cache).fill_(float("nan"))  # no slot is read before it is written
    # Sequence 0: a 5-token prompt in blocks [6, 1]; sequence 1: decode of token 11 in blocks [3, 0].
    k_old = torch.randn(10, hkv, d, generator=g) * 3
    v_old = torch.randn(10, hkv, d, generator=g)
    old_slots = torch.tensor([3 * bs + i for i in range(8)] + [0, 1], device=DEVICE)
    reference.write_kv_cache(k_old.to(DEVICE), v_old.to(DEVICE), cache[1, 0], cache[1, 1], old_slots)
    slots = torch.tensor([6 * bs + i for i in range(5)] + [2], device=DEVICE)
    k_new = (torch.randn(6, hkv, d, generator=g) * 3).to(DEVICE)
    v_new = torch.randn(6, hkv, d, generator=g).to(DEVICE)
    q = _query(6, heads, d, torch.float32, 31)
    step = kernels.prepare_step(
        cache,
        heads,
        0.2,
        slots,
        5,
        prefill=(
            torch.tensor([[6, 1]], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 5], dtype=torch.int32, device=DEVICE),
            torch.tensor([5], dtype=torch.int32, device=DEVICE),
        ),
        max_query_len=5,
        decode=(
            torch.tensor([[3, 0]], dtype=torch.int32, device=DEVICE),
            torch.tensor([11], dtype=torch.int32, device=DEVICE),
        ),
    )
    assert step.backend_name == "triton"
    step.write_kv_cache(k_new, v_new, cache[1, 0], cache[1, 1])
    got = step.attention(q, cache[1, 0], cache[1, 1])
    want = qc.oracle(q, cache[1, 0], cache[1, 1], [[6, 1], [3, 0]], [5, 11], [5, 1], 0.2)
    assert_matches(got, want, torch.float32)
