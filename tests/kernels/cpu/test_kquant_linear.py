"""The native K-quant linear kernel (kernels/cpu/csrc/quant_linear.c, ``pagedkv_kq_linear``) on GGUF
Q4_K / Q6_K super-blocks held as the file holds them, against float64 products of the gguf
package's own dequantization, in every variant this CPU runs (the AVX2 code and the plain C
fallback): blocks quantized from random weights and blocks of random bytes, matrices joining Q4_K
and Q6_K row segments, odd row counts (1 and 7 included, across the one-row and the 4-row panel
paths), inputs read from and outputs written into NaN-poisoned buffers; row lookups exact; a
mutated scale byte, sub-block or segment turns the comparison red.

The kernel multiplies x rounded to 8-bit integers per 256 inputs (one scale max|x| / 127 per
super-block of inputs), so the float64 reference takes x rounded the same way
(``kquant_cases.round_inputs_as_the_kernel_does``, written from the rule, not from the kernel); a
separate test bounds what that rounding costs against the exact x."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.kernels import quant_linear
from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kernels.cpu import quant_linear as cpu_quant_linear
from pagedkv.kernels.quant_linear import QuantizedLinear, QuantizedMatrix
from pagedkv.worker_svc.model import linear
from tests.kernels import kquant_cases, poisoned_io

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built")
gguf = pytest.importorskip("gguf")


def _segments(layout: list[tuple[str, int]], k: int, seed: int, source: str) -> list[tuple[str, np.ndarray]]:
    out = []
    for i, (qtype, rows) in enumerate(layout):
        if source == "quantized":
            w = np.random.default_rng(seed + i).standard_normal((rows, k)).astype(np.float32) * 0.1
            out.append((qtype, kquant_cases.quantize(w, qtype)))
        else:
            out.append((qtype, kquant_cases.random_blocks(rows, k, qtype, seed + i)))
    return out


def _pack(segs: list[tuple[str, np.ndarray]]) -> QuantizedMatrix:
    return quant_linear.pack_kquant([(t, torch.from_numpy(raw.copy())) for t, raw in segs])


def _reference(segs: list[tuple[str, np.ndarray]]) -> torch.Tensor:
    """float64 ``[n, k]``: the gguf package's weights of each segment, stacked."""
    return torch.from_numpy(np.concatenate([kquant_cases.dequantize(raw, t) for t, raw in segs])).double()


def _kernel_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return kquant_cases.round_inputs_as_the_kernel_does(x).double() @ w.t()


def _tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 rounding of a sum over k (and of Q4_K's d * sc * q - dmin * m, fused or not): a few
    ulps of sum |x| |w| per output."""
    return 2e-6 * (x.double().abs() @ w.abs().t()) + 1e-6


# (segments, k, rows): rows 1-5 take the row-by-row kernel (one row, or 4-row groups with a tail of
# 1-3), 6 and more the rows-side-by-side kernel (x in groups of 8 rows, the last one partial, the
# weight rows in tiles of 4 that never cross a segment, so a segment of 1-3 or 4j + 1..3 rows ends
# in a short tile); one to three super-blocks per row.
CASES = [
    ([("Q4_K", 1)], 256, 1),
    ([("Q4_K", 17)], 512, 5),
    ([("Q6_K", 40)], 768, 1),
    ([("Q6_K", 9)], 256, 4),
    ([("Q4_K", 20), ("Q6_K", 13)], 512, 1),
    ([("Q4_K", 16), ("Q4_K", 3), ("Q6_K", 8)], 256, 3),
    ([("Q6_K", 5), ("Q4_K", 30)], 768, 7),
    ([("Q4_K", 33), ("Q6_K", 31)], 256, 21),
    ([("Q4_K", 2), ("Q6_K", 6), ("Q4_K", 7)], 512, 6),
    ([("Q6_K", 1), ("Q4_K", 4), ("Q6_K", 3)], 768, 8),
    ([("Q4_K", 9)], 256, 16),
    ([("Q6_K", 10), ("Q4_K", 1)], 256, 17),
]


@pytest.mark.parametrize("source", ["quantized", "random"])
@pytest.mark.parametrize(("layout", "k", "rows"), CASES)
def test_kquant_matches_the_float64_product_of_the_gguf_weights(
    variant: str, source: str, layout: list[tuple[str, int]], k: int, rows: int
) -> None:
    segs = _segments(layout, k, seed=k + rows, source=source)
    m = _pack(segs)
    n = sum(r for _, r in layout)
    assert m.kind == "kquant" and (m.out_features, m.in_features) == (n, k)
    assert m.qweight.numel() == sum(raw.size for _, raw in segs)  # the file's bytes, nothing more
    w = _reference(segs)
    torch.testing.assert_close(m.dequantize().double(), w, rtol=0, atol=0)
    x = poisoned_io.poisoned_rows(rows, k, seed=rows)
    err = (poisoned_io.run(m, x).double() - _kernel_reference(x, w)).abs()
    assert (err <= _tolerance(x, w)).all(), float(err.max())


@pytest.mark.parametrize("rows", [5, 9])  # row by row, rows side by side
@pytest.mark.parametrize("layout", [[("Q4_K", 48)], [("Q6_K", 48)]])
def test_rounding_x_to_8_bits_costs_at_most_half_a_step_per_input(
    variant: str, layout: list[tuple[str, int]], rows: int
) -> None:
    """Against the exact x, each output is off by at most sum_i |w_i| * d_block(i) / 2 (half of x's
    integer step in its block), and on random inputs the outputs' error is a fraction of a percent
    of their size: the trade the 8-bit products make."""
    k = 1024
    segs = _segments(layout, k, seed=31, source="quantized")
    m, w = _pack(segs), _reference(segs)
    x = torch.randn((rows, k), generator=poisoned_io.gen(6))
    x[1, :256] *= 1e-3  # blocks of very different sizes in one row
    x[2, 256:512] = 0.0  # and an all-zero block
    y = poisoned_io.run(m, x).double()
    exact = x.double() @ w.t()
    step = (x.float().reshape(rows, -1, 256).abs().amax(dim=2) / 127).double().repeat_interleave(256, dim=1)
    bound = (step / 2) @ w.abs().t() + _tolerance(x, w)
    assert ((y - exact).abs() <= bound).all()
    rel = float((y - exact).norm() / exact.norm())
    assert 1e-5 < rel < 1e-2, rel  # rounded (not exact), and by little


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_input_makes_its_rows_outputs_nan_and_only_its(variant: str, bad: float) -> None:
    """Rounding x to integers must not hide a NaN or an infinity (as an fp32 product would not):
    the row holding one gets NaN outputs; the other rows are computed as usual."""
    segs = _segments([("Q4_K", 6), ("Q6_K", 5)], 512, seed=12, source="quantized")
    m, w = _pack(segs), _reference(segs)
    for rows in (1, 5, 11):  # the one-row call, a four-row group and its tail, rows side by side
        x = torch.randn((rows, 512), generator=poisoned_io.gen(rows))
        x[rows // 2, 300] = bad
        y = cpu_quant_linear.matmul(m, x).double()
        assert torch.isnan(y[rows // 2]).all()
        ok = [r for r in range(rows) if r != rows // 2]
        assert ((y[ok] - _kernel_reference(x[ok], w)).abs() <= _tolerance(x[ok], w)).all()


def test_many_rows_over_threads_match_one_thread() -> None:
    """A prefill's rows split over threads (the panels) give what one thread gives, bit for bit."""
    segs = _segments([("Q4_K", 70), ("Q6_K", 30)], 512, seed=3, source="quantized")
    m = _pack(segs)
    x = torch.randn((37, 512), generator=poisoned_io.gen(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_quant_linear.matmul(m, x)
        torch.set_num_threads(2)
        two = cpu_quant_linear.matmul(m, x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    w = _reference(segs)
    assert ((one.double() - _kernel_reference(x, w)).abs() <= _tolerance(x, w)).all()


@pytest.mark.parametrize("arith", [cpu_quant_linear.ARITH_ROWS, cpu_quant_linear.ARITH_PANELS])
def test_rows_and_panels_give_a_row_the_same_bits_at_every_row_count(variant: str, arith: int) -> None:
    """As for int4 and int8 (test_quant_linear.py): under ARITH_ROWS (the row-by-row kernel at any
    row count) and ARITH_PANELS (x's rows side by side at any count) a row's result does not depend
    on its call's other rows; one row under ARITH_ROWS is a one-row call's default."""
    k = 512
    m = _pack(_segments([("Q4_K", 24), ("Q6_K", 17)], k, 5, "quantized"))
    x = torch.randn((21, k), generator=poisoned_io.gen(6))
    alone = torch.cat([cpu_quant_linear.matmul(m, x[r : r + 1], arith=arith) for r in range(21)])
    for rows in (1, 2, 4, 5, 6, 9, 17, 21):
        assert torch.equal(cpu_quant_linear.matmul(m, x[:rows], arith=arith), alone[:rows]), rows
    if arith == cpu_quant_linear.ARITH_ROWS:
        assert torch.equal(alone[:1], cpu_quant_linear.matmul(m, x[:1]))


def test_row_lookup_is_the_gguf_packages_dequantization_exactly(variant: str) -> None:
    segs = _segments([("Q4_K", 11), ("Q6_K", 6)], 512, seed=9, source="random")
    m = _pack(segs)
    w = _reference(segs).float()
    ids = torch.tensor([0, 10, 11, 16, 3, 3])
    assert torch.equal(m.rows(ids), w[ids])
    assert torch.equal(quant_linear._kquant_rows(m, ids), w[ids])  # the path without the library
    with pytest.raises(ValueError, match="row ids"):
        m.rows(torch.tensor([17]))


def test_a_wrong_scale_sub_block_or_segment_is_caught() -> None:
    """Each mutation of a correct packing (what a layout or indexing bug would do) puts the
    kernel's outputs far outside the tolerance above, and the kernel still computes exactly what
    the mutated bytes say (so the tolerance, not luck, is what catches it)."""
    k = 512
    segs = _segments([("Q4_K", 9), ("Q6_K", 7)], k, seed=5, source="quantized")
    w = _reference(segs)
    x = torch.randn((1, k), generator=poisoned_io.gen(2))
    x4 = torch.randn((5, k), generator=poisoned_io.gen(3))
    x9 = torch.randn((9, k), generator=poisoned_io.gen(4))  # rows side by side

    def q4k_scale_byte(raw: list[np.ndarray]) -> None:
        raw[0][2, 4 + 1] ^= 0x05  # a 6-bit sub-scale of row 2's first super-block

    def q4k_min_byte(raw: list[np.ndarray]) -> None:
        raw[0][4, 144 + 8 + 2] ^= 0x30  # high bits of a minimum in row 4's second super-block

    def q4k_sub_blocks_swapped(raw: list[np.ndarray]) -> None:
        qs = raw[0][1, 16:144].copy()  # row 1: sub-blocks 0/1 share bytes 0..31 with 2/3's 32..63
        raw[0][1, 16:144] = np.concatenate([qs[32:64], qs[0:32], qs[64:]])

    def q6k_scale_byte(raw: list[np.ndarray]) -> None:
        raw[1][3, 210 + 192 + 5] ^= 0x11  # an int8 sub-scale of row 3's second super-block

    def q6k_high_bits(raw: list[np.ndarray]) -> None:
        raw[1][0, 128 + 7] ^= 0x0C  # the high 2 bits of one weight in chunk 1

    for mutate in (q4k_scale_byte, q4k_min_byte, q4k_sub_blocks_swapped, q6k_scale_byte, q6k_high_bits):
        raw = [r.copy() for _, r in segs]
        mutate(raw)
        mutated = [(t, r) for (t, _), r in zip(segs, raw, strict=True)]
        m, w_mut = _pack(mutated), _reference(mutated)
        for xs in (x, x4, x9):
            y = cpu_quant_linear.matmul(m, xs).double()
            assert ((y - _kernel_reference(xs, w)).abs() > 100 * _tolerance(xs, w)).any(), mutate.__name__
            assert ((y - _kernel_reference(xs, w_mut)).abs() <= _tolerance(xs, w_mut)).all(), mutate.__name__
    # The segments read as another type: its rows are other bytes entirely.
    m = _pack(segs)
    one_more_q4 = QuantizedMatrix(m.qweight, torch.tensor([[12, 10], [14, 6]], dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="whole number of super-blocks"):
        cpu_quant_linear.matmul(one_more_q4, x)


@pytest.mark.parametrize(
    ("segs", "match"),
    [
        ([[13, 4]], "type"),  # Q5_K is not held as kquant
        ([[12, 3]], "summing to 4"),
        ([[12, 0], [12, 4]], "rows > 0"),
    ],
)
def test_a_bad_segment_table_is_refused_before_the_kernel_runs(segs: list[list[int]], match: str) -> None:
    m = _pack(_segments([("Q4_K", 4)], 256, seed=1, source="random"))
    bad = QuantizedMatrix(m.qweight, torch.tensor(segs, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=match):
        cpu_quant_linear.prepare(bad)


def test_the_model_layers_take_the_native_kquant_kernel_and_torch_without_it() -> None:
    segs = _segments([("Q4_K", 24), ("Q6_K", 8)], 256, seed=2, source="quantized")
    m = _pack(segs)
    w = _reference(segs)
    x = torch.randn((3, 256), generator=poisoned_io.gen(8))
    native, plain = linear.Linear.build(m), linear.Linear.build(m, native=False)
    assert (native.path, plain.path) == ("native-kquant", "kquant")
    assert QuantizedLinear.build(m).private_bytes == 0 and plain.qlinear is not None
    assert plain.qlinear.private_bytes == 4 * w.numel()  # torch has no K-quant op: an fp32 copy
    # The native kernel multiplies x rounded to 8 bits; torch's path multiplies the exact x.
    for layer, ref in ((native, _kernel_reference(x, w)), (plain, x.double() @ w.t())):
        assert ((layer(x).double() - ref).abs() <= _tolerance(x, w)).all(), layer.path
