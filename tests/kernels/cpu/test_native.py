"""The native CPU kernels (kernels/cpu/csrc/ via kernels/cpu/native.py).

Decode attention against the torch reference on fresh random inputs with NaN-poisoned outputs:
GQA groups of 1-8, head sizes 64/80/128, long contexts with large scores (the vectorized exp),
zero-length rows, fp32 and bf16, strided layer views. The row log-sum-exp against
torch.logsumexp, infinities and NaN included. Then what happens when they are missing or switched
off (how they are built and chosen: test_cpu_native_build.py).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import quant, reference
from pagedkv.kernels.cpu import attention as cpu
from pagedkv.kernels.cpu import native as cpu_native
from tests.kernels import cases
from tests.kernels.cases import assert_close, generator, make_paged, poisoned_like, ragged_lens, randn

pytestmark = pytest.mark.skipif(
    not cpu_native.available(), reason="the native kernels were not built at install"
)


@pytest.fixture(autouse=True)
def _cpu_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build every case on CPU tensors, also where ``cases.DEVICE`` is CUDA (the GPU image has a C
    compiler): the native kernels read host memory, and CUDA pointers there would be a segfault."""
    monkeypatch.setattr(cases, "DEVICE", torch.device("cpu"))


def _check(case, num_heads: int, dtype: torch.dtype, seed: int, q_scale: float = 1.0) -> None:  # type: ignore[no-untyped-def]
    n, d = case.seq_lens.shape[0], case.key_cache.shape[3]
    q = randn((n, num_heads, d), dtype, generator(seed)) * q_scale
    out = poisoned_like(q)
    tables, lens = case.block_tables.to(torch.int32).contiguous(), case.seq_lens.to(torch.int32).contiguous()
    assert cpu_native.supports(q, case.key_cache, case.value_cache)
    got = cpu_native.decode(q, case.key_cache, case.value_cache, tables, lens, d**-0.5, out)
    assert got is out
    want = reference.paged_decode_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, d**-0.5
    )
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 64), (8, 8, 128), (8, 1, 80), (4, 2, 128)]
)
def test_decode_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, variant: str
) -> None:
    """(``variant``: each build's key batch and butterfly sum.)"""
    case = make_paged(
        ragged_lens(16, 200) + [1, 15, 16, 17], 16, num_kv_heads, head_dim, dtype, seed=head_dim
    )
    _check(case, num_heads, dtype, seed=num_heads)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize(("num_seqs", "num_kv_heads"), [(1, 3), (2, 8), (5, 3), (40, 3)])
def test_heads_split_over_tasks_when_sequences_are_few(
    threads: int, num_seqs: int, num_kv_heads: int, variant: str
) -> None:
    """A task takes all of a sequence's KV heads unless there are fewer than four sequences per
    thread; then the heads are split over tasks (csrc/paged_decode.c, heads_per_task). Every split,
    including uneven ones, must write each head's rows where they belong."""
    lens = [17 + 37 * i for i in range(num_seqs)]
    case = make_paged(lens, 16, num_kv_heads, 64, torch.float32, seed=num_seqs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(case, 3 * num_kv_heads, torch.float32, seed=threads)
    finally:
        torch.set_num_threads(before)


def _fp64_attention(q: torch.Tensor, case, scale: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Decode attention in float64, one (sequence, head) at a time: the ground truth."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    bs, hkv = case.key_cache.shape[1], case.key_cache.shape[2]
    group = q.shape[1] // hkv
    for s, n in enumerate(case.seq_lens.tolist()):
        if n == 0:
            continue
        blocks = case.block_tables[s, : -(-n // bs)].long()
        k = case.key_cache[blocks].reshape(-1, hkv, q.shape[2])[:n].double()
        v = case.value_cache[blocks].reshape(-1, hkv, q.shape[2])[:n].double()
        for h in range(q.shape[1]):
            p = torch.softmax(k[:, h // group] @ q[s, h].double() * scale, 0)
            out[s, h] = p @ v[:, h // group]
    return out


@pytest.mark.parametrize("block_size", [8, 64])
def test_block_sizes_around_the_key_batches(block_size: int, variant: str) -> None:
    """Blocks smaller than the keys scored together (a vector's width: 16 keys on AVX-512, where
    every key of an 8-slot block goes one at a time; 8 on AVX2; 4 on the baseline build) and
    larger (several batches per block, a ragged last one)."""
    case = make_paged([1, 7, 16, 33, 250, 129], block_size, 2, 64, torch.float32, seed=block_size)
    _check(case, 8, torch.float32, seed=7)


def test_long_contexts_with_sharp_scores_and_empty_rows() -> None:
    """Scores spread over hundreds of units (most exp() terms underflow), 3,000-token contexts,
    block size 32, and sequences of length 0 (their rows come back as zeros, not NaN). Sharp
    scores amplify fp32 rounding, so both the kernel and the reference are measured against a
    float64 computation: the kernel may be at most twice as far from it as the reference is."""
    case = make_paged([3000, 0, 1, 2047, 0, 513], 32, 2, 64, torch.float32, seed=3)
    q = randn((6, 8, 64), torch.float32, generator(4)) * 30.0
    got = cpu_native.decode(
        q,
        case.key_cache,
        case.value_cache,
        case.block_tables.to(torch.int32).contiguous(),
        case.seq_lens.to(torch.int32).contiguous(),
        0.125,
        poisoned_like(q),
    )
    want = reference.paged_decode_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125
    )
    truth = _fp64_attention(q, case, 0.125)
    assert not torch.isnan(got).any()
    assert torch.equal(got[1], torch.zeros_like(got[1])) and torch.equal(got[4], torch.zeros_like(got[4]))
    kernel_err = (got.double() - truth).abs().max().item()
    reference_err = (want.double() - truth).abs().max().item()
    assert kernel_err <= 2 * reference_err + 1e-6, (kernel_err, reference_err)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("lens", [[40], [300, 0], [17, 130, 1, 600], [64, 65]])
def test_a_few_sequences_contexts_run_in_parts_and_merge(lens: list[int], kv_dtype: torch.dtype) -> None:
    """Up to four sequences, each context of 4 blocks or more is cut into two runs of whole blocks
    (here 3 blocks -> one run; 4, 5, 9, 19 and 38 -> two, the odd ones cut unevenly), each run
    attended over its KV heads in one task or, with more threads than runs, in head groups, and
    the runs merged by their largest scores and sums (csrc/paged_decode.c, decode_split). Sharp
    scores (most terms of a run underflow, so a wrong merge weight shows) against float64: the
    split kernel no further from it than the same sequences unsplit (among empty ones past the
    split's four sequences), so cutting a context costs no accuracy (the torch reference is no
    yardstick here: its error on sharp scores ranges over 10x with the summation order of its
    dot products, and the kernel's with the build's vector width); a row of length 0 comes back
    as zeros with log-sum-exp -inf; the log-sum-exp a cascade merges with is the float64 one; and
    the cut depends on the shapes only, so 1 to 4 threads give the same bits."""
    scale = 0.125
    if kv_dtype is torch.int8:
        dense = make_paged(lens, 16, 3, 64, torch.float32, seed=len(lens))
        kc = quant.pack(*quant.quantize(dense.key_cache, torch.int8))
        vc = quant.pack(*quant.quantize(dense.value_cache, torch.int8))
        case = cases.PagedCache(kc, vc, dense.block_tables, dense.seq_lens)
        truth_case = cases.PagedCache(
            quant.dequantize(kc), quant.dequantize(vc), dense.block_tables, dense.seq_lens
        )
    else:
        case = truth_case = make_paged(lens, 16, 3, 64, torch.float32, seed=len(lens))
    n = len(lens)
    q = randn((n, 9, 64), torch.float32, generator(n)) * 20.0
    tables, seq_lens = (
        case.block_tables.to(torch.int32).contiguous(),
        case.seq_lens.to(torch.int32).contiguous(),
    )
    lib = cpu_native.library()
    assert lib is not None
    fn = lib.pagedkv_decode_i8_lse if kv_dtype is torch.int8 else lib.pagedkv_decode_f32_lse

    def run(
        q: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = poisoned_like(q), torch.full((q.shape[0], 9), float("nan"))
        args = cpu_native._kernel_args(q.shape[0], q, case.key_cache, tables, scale, out, generic_only=False)
        cpu_native._launch(fn, args, q, case.key_cache, case.value_cache, tables, seq_lens, out, lse)
        return out, lse

    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            results.append(run(q, tables, seq_lens))
        pad = 5 - n  # empty sequences past the split's limit: the same rows, unsplit
        unsplit, _ = run(
            torch.cat([q, randn((pad, 9, 64), torch.float32, generator(99))]),
            torch.cat([tables, torch.zeros((pad, tables.shape[1]), dtype=torch.int32)]),
            torch.cat([seq_lens, torch.zeros(pad, dtype=torch.int32)]),
        )
    finally:
        torch.set_num_threads(before)
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    got, lse = results[0]
    truth = _fp64_attention(q, truth_case, scale)
    kernel_err = (got.double() - truth).abs().max().item()
    unsplit_err = (unsplit[:n].double() - truth).abs().max().item()
    assert kernel_err <= 1.5 * unsplit_err + 1e-6 and kernel_err < 1e-4, (kernel_err, unsplit_err)
    for s, length in enumerate(lens):
        if length == 0:
            assert torch.equal(got[s], torch.zeros_like(got[s])) and bool((lse[s] == -torch.inf).all())
            continue
        blocks = truth_case.block_tables[s, : -(-length // 16)].long()
        k = truth_case.key_cache[blocks].reshape(-1, 3, 64)[:length].double()
        scores = torch.einsum("hd,thd->ht", q[s].double(), k.repeat_interleave(3, 1))
        assert torch.allclose(lse[s].double(), torch.logsumexp(scores * scale, 1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("layout", ["layers", "blocks_outer"])
def test_strided_layer_views(layout: str) -> None:
    case = make_paged([5, 64, 300, 17], 16, 2, 64, torch.float32, seed=9, layout=layout)
    _check(case, 8, torch.float32, seed=10)


def test_fp16_and_strided_queries_are_not_taken() -> None:
    case = make_paged([20], 16, 2, 64, torch.float16, seed=1)
    q = randn((1, 8, 64), torch.float16, generator(2))
    assert not cpu_native.supports(q, case.key_cache, case.value_cache)
    q32 = randn((1, 8, 128), torch.float32, generator(2))[:, :, ::2]  # head_dim not contiguous
    case32 = make_paged([20], 16, 2, 64, torch.float32, seed=1)
    assert not cpu_native.supports(q32, case32.key_cache, case32.value_cache)


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_logsumexp_rows_matches_torch(scale: float) -> None:
    big = randn((50, 32_100), torch.float32, generator(int(scale))) * scale
    logits = big[1:49, 3:32_003]  # rows strided inside a bigger tensor
    got = cpu_native.logsumexp_rows(logits)
    torch.testing.assert_close(got, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)


def test_logsumexp_rows_infinities_and_nan_as_torch() -> None:
    logits = randn((5, 1000), torch.float32, generator(3))
    logits[0, 10:900] = float("-inf")  # some -inf: ignored
    logits[1] = float("-inf")  # all -inf: -inf
    logits[2, 7] = float("inf")  # +inf wins
    logits[3, 999] = float("nan")  # NaN anywhere: NaN
    got = cpu_native.logsumexp_rows(logits)
    want = torch.logsumexp(logits, dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, equal_nan=True)
    assert got[1] == float("-inf") and got[2] == float("inf") and torch.isnan(got[3])


def test_logsumexp_rows_leaves_other_inputs_to_torch() -> None:
    logits64 = torch.randn(3, 100, dtype=torch.float64, generator=generator(1))
    assert torch.equal(cpu_native.logsumexp_rows(logits64), torch.logsumexp(logits64, dim=-1))
    column = torch.randn(100, 3, generator=generator(2)).t()  # rows not contiguous
    assert torch.equal(cpu_native.logsumexp_rows(column), torch.logsumexp(column, dim=-1))


@pytest.mark.parametrize("cols", [7, 256, 1000, 32_000, 49_153])
def test_logsumexp_argmax_rows_is_torchs_argmax_and_logsumexp(cols: int) -> None:
    big = randn((41, cols + 5), torch.float32, generator(cols)) * 8.0
    logits = big[1:40, 2 : 2 + cols]  # rows strided inside a bigger tensor
    fused = cpu_native.logsumexp_argmax_rows(logits)
    assert fused is not None
    lse, idx = fused
    assert idx.dtype == torch.int64 and torch.equal(idx, torch.argmax(logits, dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)


def test_logsumexp_argmax_rows_ties_infinities_and_nan_as_torch() -> None:
    """torch.argmax's first index of the maximum, across and inside the kernel's 256-column chunks."""
    logits = randn((9, 1000), torch.float32, generator(5))
    logits[0, [300, 700]] = 50.0  # tie in two chunks: the first
    logits[1, [257, 260]] = 50.0  # tie inside one chunk: the first
    logits[2, [999, 998]] = 50.0  # in the ragged last chunk
    logits[3] = 3.0  # all equal: 0
    logits[4] = float("-inf")  # all -inf: 0, and -inf
    logits[5, [5, 600]] = float("inf")  # +inf twice: the first, and +inf
    logits[6, [800, 3]] = float("nan")  # NaN: the first NaN, and NaN
    logits[7, 0] = 50.0  # the very first column
    logits[8, 10:999] = float("-inf")  # mostly -inf
    fused = cpu_native.logsumexp_argmax_rows(logits)
    assert fused is not None
    lse, idx = fused
    assert idx.tolist() == torch.argmax(logits, dim=-1).tolist()
    assert idx[:8].tolist() == [300, 257, 998, 0, 0, 5, 3, 0]
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5, equal_nan=True)


def test_logsumexp_argmax_rows_leaves_other_inputs_to_the_caller() -> None:
    assert cpu_native.logsumexp_argmax_rows(torch.randn(3, 100, dtype=torch.float64)) is None
    assert cpu_native.logsumexp_argmax_rows(torch.randn(100, 3).t()) is None  # rows not contiguous
    assert cpu_native.logsumexp_argmax_rows(torch.empty(3, 0)) is None


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the loaded library so the next call looks for (and chooses) a variant again."""
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_variant", None)
    monkeypatch.setattr(cpu_native, "_tried", False)


def test_without_a_compiler_the_bucket_path_runs(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """An install without a C compiler builds no library (setup.py's variants are optional)."""
    monkeypatch.setattr(cpu_native, "artifact", lambda variant: None)
    assert not cpu_native.available()
    case = make_paged([40, 300], 16, 2, 64, torch.float32, seed=5)
    plan = cpu.plan_decode(case.block_tables, case.seq_lens, 16)
    assert plan.native_tables is None and plan.buckets
    q = randn((2, 8, 64), torch.float32, generator(6))
    got = cpu.paged_decode_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125, plan=plan
    )
    want = reference.paged_decode_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125
    )
    assert_close(got, want, torch.float32)


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_native.ENV_SWITCH, "off")
    assert cpu_native.library() is None
    case = make_paged([40], 16, 2, 64, torch.float32, seed=5)
    assert cpu.plan_decode(case.block_tables, case.seq_lens, 16).native_tables is None


def _word_sum(tensors: list[torch.Tensor]) -> int:
    """read_spans' checksum written out: each tensor's bytes as little-endian 64-bit words plus its
    tail bytes, all summed modulo 2**64."""
    total = 0
    for t in tensors:
        b = bytes(t.reshape(-1).view(torch.uint8).numpy())
        words = len(b) // 8
        total += sum(int.from_bytes(b[8 * i : 8 * i + 8], "little") for i in range(words))
        total += sum(b[8 * words :])
    return total % 2**64


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_spans_reads_every_byte_of_each_span(threads: int) -> None:
    """Odd sizes (tails of 1-7 bytes), a span past the serial threshold, fp32 and int8 tensors and an
    unaligned view: the checksum is the words and tails of every byte, so a skipped or repeated
    byte (a thread's share, a tail) changes it."""
    gen = generator(5)
    sizes = (1, 7, 8, 9, 4099, 70_001 * 8 + 3)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    tensors.append(randn((333, 17), torch.float32, gen))
    tensors.append(torch.randint(-128, 128, (1000,), dtype=torch.int8, generator=gen)[3:])  # unaligned view
    assert cpu_native.read_spans(tensors, threads) == _word_sum(tensors)
    assert cpu_native.read_spans([], threads) == 0


def test_read_spans_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match=r"tensors\[1\] must be a contiguous CPU tensor"):
        cpu_native.read_spans([torch.zeros(4), torch.zeros(4, 4).t()], 2)
