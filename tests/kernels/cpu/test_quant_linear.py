"""The native int4 / int8 linear kernels (kernels/cpu/csrc/quant_linear.c through
kernels/cpu/quant_linear.py) against float64 products of the weights the integers stand for (int4:
times x rounded to 16 bits per 32 inputs, as the kernel is documented to multiply it), in every
variant this CPU runs (the AVX-512 word multiply-adds, the AVX2 code and the plain C fallback):
fresh random inputs read from
NaN-poisoned buffers, outputs written into NaN-poisoned buffers, odd shapes, padded rows whose
scales are NaN; a packing with one wrong scale, group or nibble turns the comparison red; GGUF
blocks (Q4_0, Q4_1, Q8_0) against the gguf package's own dequantization; which kernel the model's
layers take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.kernels import quant_linear
from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kernels.cpu import quant_linear as cpu_quant_linear
from pagedkv.kernels.quant_linear import GROUP, PANEL, QuantizedLinear, QuantizedMatrix
from pagedkv.worker_svc.model import gguf_quant, linear
from tests.kernels import kquant_cases, poisoned_io

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built")


def _int4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = poisoned_io.gen(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = 0.01 + 0.05 * torch.rand((n, k // GROUP), generator=g)
    offset = 0.2 * torch.randn((n, k // GROUP), generator=g)
    return q, scale, offset


def _dense4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    s, z = scale.double().repeat_interleave(GROUP, 1), offset.double().repeat_interleave(GROUP, 1)
    return (q.double() - 8) * s + z


def _poison_padding(m: QuantizedMatrix) -> None:
    """NaN scales and offsets in the padded rows of the last panel: they must never reach an output."""
    used = m.out_features - (m.qscale.shape[0] - 1) * PANEL
    m.qscale[-1, :, used:PANEL] = float("nan")
    m.qscale[-1, :, PANEL + used :] = float("nan")


def _rounded(x: torch.Tensor, kind: str = "int4") -> torch.Tensor:
    """x as the ``kind`` kernel multiplies it (its documented rule, written in the test helpers)."""
    r = cpu_quant_linear.INPUT_ROUNDING[kind]
    return kquant_cases.round_inputs_as_the_kernel_does(x, r.block, r.top)


def _tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 rounding of a sum over k: a few ulps of sum |x| |w| per output."""
    return 1e-6 * (x.double().abs() @ w.abs().t()) + 1e-6


# rows across the 2-row register tiles (and a prefill's many rows); outputs across the 16-row panel;
# groups from 1 to 18.
SHAPES4 = [
    (1, 32, 1),
    (7, 32, 2),
    (17, 96, 3),
    (33, 160, 5),
    (40, 96, 8),
    (64, 256, 9),
    (31, 544, 17),
    (960, 576, 1),
    (48, 96, 70),  # many rows: panels dequantized in pairs, an unpaired third, a 1-row tail tile
    (100, 576, 131),  # three pairs and a last partial panel through the row tiles
]


@pytest.mark.parametrize(("n", "k", "rows"), SHAPES4)
def test_int4_matches_the_float64_product_of_its_groups(
    quant_variant: str, n: int, k: int, rows: int
) -> None:
    q, scale, offset = _int4(n, k, seed=n + k)
    m = quant_linear.pack_int4(q, scale, offset)
    assert (
        m.qweight.shape == (-(-n // PANEL), k // GROUP, 256)
        and m.nbytes == m.qweight.numel() + 4 * m.qscale.numel()
    )
    _poison_padding(m)
    w = _dense4(q, scale, offset)
    x = poisoned_io.poisoned_rows(rows, k, seed=rows)
    ref = _rounded(x).double() @ w.t()
    err = (poisoned_io.run(m, x).double() - ref).abs()
    assert (err <= _tolerance(x, w)).all(), float(err.max())


@pytest.mark.parametrize("rows", [1, 3, 9])  # word products (or fp32 tiles), dequantized panels
def test_rounding_x_costs_at_most_half_a_step_per_input(quant_variant: str, rows: int) -> None:
    """Against the exact x, each output is off by at most sum_i |w_i| * d_group(i) / 2 (half of x's
    integer step in its group of 32), and on random inputs by a few parts in 100,000 of the
    outputs' size: the trade the 16-bit products make. Groups of very different sizes, and an
    all-zero one, in one row."""
    n, k = 70, 576
    q, scale, offset = _int4(n, k, seed=4)
    m, w = quant_linear.pack_int4(q, scale, offset), _dense4(q, scale, offset)
    x = torch.randn((rows, k), generator=poisoned_io.gen(6))
    x[0, :64] *= 1e-3
    x[-1, 64:96] = 0.0
    y = poisoned_io.run(m, x).double()
    exact = x.double() @ w.t()
    top = cpu_quant_linear.INPUT_ROUNDING["int4"].top
    step = (x.reshape(rows, -1, GROUP).abs().amax(dim=2) / top).double().repeat_interleave(GROUP, dim=1)
    assert ((y - exact).abs() <= (step / 2) @ w.abs().t() + _tolerance(x, w)).all()
    rel = float((y - exact).norm() / exact.norm())
    assert 1e-6 < rel < 1e-4, rel  # rounded (not exact), and by little


def _matrix(kind: str, n: int, k: int, seed: int) -> tuple[QuantizedMatrix, torch.Tensor]:
    """A random int4 or int8 matrix and the float64 weights it stands for."""
    if kind == "int4":
        q, scale, offset = _int4(n, k, seed=seed)
        return quant_linear.pack_int4(q, scale, offset), _dense4(q, scale, offset)
    m = quant_linear.quantize_int8_rows(torch.randn((n, k), generator=poisoned_io.gen(seed)))
    return m, m.qweight.double() * m.qscale.double()[:, None]


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_input_makes_its_rows_outputs_nan(quant_variant: str, bad: float, kind: str) -> None:
    """Rounding x to integers must not hide a NaN or an infinity (an fp32 product would not): the
    row holding one gets NaN outputs, the other rows are computed as usual."""
    n, k = 40, 96
    m, w = _matrix(kind, n, k, seed=2)
    for rows in (1, 3, 9):
        x = torch.randn((rows, k), generator=poisoned_io.gen(rows))
        x[rows // 2, 50] = bad
        y = cpu_quant_linear.matmul(m, x).double()
        assert torch.isnan(y[rows // 2]).all()
        ok = [r for r in range(rows) if r != rows // 2]
        assert ((y[ok] - _rounded(x[ok], kind).double() @ w.t()).abs() <= _tolerance(x[ok], w)).all()


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_rows_result_does_not_depend_on_its_batch(kind: str) -> None:
    """One row alone (word products where the CPU has them), beside a few others, and among 9 (the
    many-rows paths) multiplies the same rounded x: results within fp32 rounding of each other, so
    a sequence's tokens do not depend on how many others share its step."""
    n, k = 100, 576
    m, w = _matrix(kind, n, k, seed=8)
    x = torch.randn((9, k), generator=poisoned_io.gen(3))
    alone = cpu_quant_linear.matmul(m, x[:1]).double()
    tol = 2 * _tolerance(x[:1], w)
    for rows in (3, 7, 9):
        assert ((cpu_quant_linear.matmul(m, x[:rows]).double()[:1] - alone).abs() <= tol).all()


# row tiles and their tails (the VNNI tiles of 4, the AMX tiles of up to 16 rows from 4), a
# speculative verification's 9, past a tile of 16 and a block of 64
ARITH_ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 16, 17, 31, 64, 70)


@pytest.mark.parametrize(
    ("kind", "n", "k"),
    # int4: 18 groups (the AMX path's passes of 8 groups and a tail of 2), 3 groups (one short
    # pass), 10 groups over 4 panels the last of which holds 2 outputs
    [("int4", 100, 576), ("int4", 40, 96), ("int4", 50, 320), ("int8", 100, 576), ("int8", 7, 37)],
)
@pytest.mark.parametrize("arith", [cpu_quant_linear.ARITH_ROWS, cpu_quant_linear.ARITH_PANELS])
def test_rows_and_panels_give_a_row_the_same_bits_at_every_row_count(
    quant_variant: str, kind: str, n: int, k: int, arith: int
) -> None:
    """ARITH_ROWS (a decode step's and a speculative verification's rows) and ARITH_PANELS (a
    prefill's) give every row the same bits whatever the row count of its call and its place in it,
    on every path (word products, fp32 tiles, plain loops; a partial panel of 8 rows, a width that
    is not whole groups): a sequence's tokens must not depend on what shares its step, and a
    verification pass must compute each position as plain decoding does. Under ARITH_ROWS one row is
    exactly what a call of one row gives by default (the decode path), under ARITH_PANELS many rows
    exactly what a call of many does."""
    m, _ = _matrix(kind, n, k, seed=11)
    x = torch.randn((max(ARITH_ROW_COUNTS), k), generator=poisoned_io.gen(12))
    alone = torch.cat([cpu_quant_linear.matmul(m, x[r : r + 1], arith=arith) for r in range(x.shape[0])])
    for rows in ARITH_ROW_COUNTS:
        for first in (0, 3):  # the same rows at other places in their call
            got = cpu_quant_linear.matmul(m, x[first : first + rows], arith=arith)
            assert torch.equal(got, alone[first : first + rows]), (rows, first)
    if arith == cpu_quant_linear.ARITH_ROWS:
        assert torch.equal(alone[:1], cpu_quant_linear.matmul(m, x[:1]))
    else:
        assert torch.equal(alone, cpu_quant_linear.matmul(m, x))


def test_an_unknown_arithmetic_is_refused() -> None:
    m, _ = _matrix("int4", 16, 32, seed=1)
    with pytest.raises(ValueError, match="arith"):
        cpu_quant_linear.matmul(m, torch.randn(2, 32), arith=3)


# rows 2-3 through the 4-row blocks; from 4 rows blocks of 4 weight rows widened once, tiles of 3
# rows (5 and 70 leave a tail), odd widths (577, 17, 37) past the 8-input steps.
SHAPES8 = [
    (1, 1, 1),
    (7, 37, 2),
    (5, 8, 3),
    (6, 37, 4),
    (33, 577, 5),
    (128, 17, 8),
    (64, 576, 9),
    (49, 1536, 1),
    (30, 100, 70),
    # one row (a decode step's output layer) has a path of its own: 32-input steps, 8-input steps
    # and a scalar tail, over enough rows for every thread
    (33, 577, 1),
    (2048, 45, 1),
    (300, 576, 1),  # 16-bit products where the CPU has them (a width of whole groups of 32)
]


@pytest.mark.parametrize(("n", "k", "rows"), SHAPES8)
def test_int8_matches_the_float64_product_of_its_rows(quant_variant: str, n: int, k: int, rows: int) -> None:
    m, w = _matrix("int8", n, k, seed=k)
    x = poisoned_io.poisoned_rows(rows, k, seed=rows)
    ref = _rounded(x, "int8").double() @ w.t()
    err = (poisoned_io.run(m, x).double() - ref).abs()
    assert (err <= _tolerance(x, w)).all(), float(err.max())


def test_a_wrong_scale_group_or_nibble_in_the_packing_is_caught() -> None:
    """Each mutation of a correct packing (what a packing or indexing bug would do) puts the
    kernels' outputs far outside the tolerance the tests above hold them to."""
    n, k = 40, 128
    q, scale, offset = _int4(n, k, seed=5)
    w = _dense4(q, scale, offset)
    x = torch.randn((3, k), generator=poisoned_io.gen(2))
    ref, tol = _rounded(x).double() @ w.t(), _tolerance(x, w)

    def swap_group_scales(m: QuantizedMatrix) -> None:
        m.qscale[0, [0, 1], :PANEL] = m.qscale[0, [1, 0], :PANEL].clone()

    def offsets_one_row_off(m: QuantizedMatrix) -> None:
        m.qscale[1, 2, PANEL:] = m.qscale[1, 2, PANEL:].roll(1)

    def nibbles_one_group_off(m: QuantizedMatrix) -> None:
        m.qweight.copy_(m.qweight.roll(1, dims=1))

    def half_panels_swapped(m: QuantizedMatrix) -> None:
        m.qweight.copy_((m.qweight >> 4) | (m.qweight << 4))

    def inputs_one_off(m: QuantizedMatrix) -> None:
        m.qweight[0, 0] = m.qweight[0, 0].reshape(GROUP, 8).roll(1, dims=0).reshape(-1)

    def mutants() -> list[QuantizedMatrix]:
        out = []
        for mutate in (
            swap_group_scales,
            offsets_one_row_off,
            nibbles_one_group_off,
            half_panels_swapped,
            inputs_one_off,
        ):
            m = quant_linear.pack_int4(q, scale, offset)
            mutate(m)
            out.append(m)
        return out

    assert ((poisoned_io.run(quant_linear.pack_int4(q, scale, offset), x).double() - ref).abs() <= tol).all()
    for m in mutants():
        assert ((cpu_quant_linear.matmul(m, x).double() - ref).abs() > 100 * tol).any()
    m8 = quant_linear.quantize_int8_rows(torch.randn((n, k), generator=poisoned_io.gen(6)))
    w8 = m8.qweight.double() * m8.qscale.double()[:, None]
    ref8, tol8 = _rounded(x, "int8").double() @ w8.t(), _tolerance(x, w8)
    assert ((poisoned_io.run(m8, x).double() - ref8).abs() <= tol8).all()
    wrong = QuantizedMatrix(m8.qweight, m8.qscale.roll(1), n)  # each row read with its neighbour's scale
    assert ((cpu_quant_linear.matmul(wrong, x).double() - ref8).abs() > 100 * tol8).any()
    assert ((cpu_quant_linear.matmul(wrong, x[:1]).double() - ref8[:1]).abs() > 100 * tol8[:1]).any()
    shifted = QuantizedMatrix(m8.qweight.roll(1, dims=1), m8.qscale, n)  # inputs one off within a row
    assert ((cpu_quant_linear.matmul(shifted, x[:1]).double() - ref8[:1]).abs() > 100 * tol8[:1]).any()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_through_the_kernels_match_the_gguf_packages_dequantization(qtype: str) -> None:
    """GGUF blocks as the model holds them (Q4_0 / Q4_1 as int4 groups, exactly; Q8_0 requantized to
    int8 rows, each weight within half a step) times fresh inputs, against float64 products of
    ``gguf.quants.dequantize``'s weights."""
    gguf = pytest.importorskip("gguf")
    n, k = 45, 320
    w = np.random.default_rng(7).standard_normal((n, k)).astype(np.float32) * 0.1
    qt = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, qt)
    file_w = torch.from_numpy(
        np.asarray(gguf.quants.dequantize(raw, qt), dtype=np.float32).reshape(n, k)
    ).double()
    held = (
        gguf_quant.int4_parts(raw, qtype, (n, k)) if qtype != "Q8_0" else gguf_quant.to_int8(file_w.float())
    )
    m = held.pack()
    x = poisoned_io.poisoned_rows(4, k, seed=8)
    if qtype == "Q8_0":
        step = file_w.abs().amax(dim=1, keepdim=True) / 127  # the requantization's half step, per weight
        tol = x.double().abs() @ (step / 2).expand(n, k).t() + _tolerance(x, file_w)
        ref = _rounded(x, "int8").double() @ file_w.t()
    else:
        tol = 1e-6 * (x.double().abs() @ file_w.abs().t()) + 1e-6
        ref = _rounded(x).double() @ file_w.t()
    err = (poisoned_io.run(m, x).double() - ref).abs()
    assert (err <= tol).all(), float(err.max())


def test_bad_arguments_are_refused_naming_the_problem() -> None:
    q, scale, offset = _int4(16, 64, seed=0)
    m = quant_linear.pack_int4(q, scale, offset)
    with pytest.raises(ValueError, match="positive multiple of 32"):
        quant_linear.pack_int4(q[:, :48], scale, offset)  # int4 groups need whole groups of inputs
    with pytest.raises(ValueError, match=r"\[rows, 64\] with dense columns"):
        cpu_quant_linear.matmul(m, torch.randn(2, 32))
    with pytest.raises(ValueError, match="dense columns"):
        cpu_quant_linear.matmul(m, torch.randn(64, 2).t())
    with pytest.raises(ValueError, match="2-D fp32 CPU tensor"):
        cpu_quant_linear.matmul(m, torch.randn(2, 64, dtype=torch.float64))
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="overlap"):
        cpu_quant_linear.matmul(m, x, out=torch.empty(32).as_strided((3, 16), (1, 1)))
    with pytest.raises(ValueError, match="a int4 matrix of 16 rows needs"):
        cpu_quant_linear.matmul(QuantizedMatrix(m.qweight[:, :1], m.qscale, 16), x)
    with pytest.raises(ValueError, match="a int8 matrix of 5 rows needs"):
        cpu_quant_linear.prepare(QuantizedMatrix(torch.zeros(5, 8, dtype=torch.int8), torch.ones(4), 5))

    buf = torch.randn(3, 80)
    with pytest.raises(ValueError, match="share memory"):
        cpu_quant_linear.matmul(m, buf[:, :64], out=buf[:, 64:])


def test_the_model_takes_the_native_kernels_at_every_row_count() -> None:
    q, scale, offset = _int4(24, 96, seed=9)
    m = quant_linear.pack_int4(q, scale, offset)
    layer = linear.Linear.build(m)
    assert layer.path == "native-int4" and linear.Linear.build(m, native=False).path == "int4"
    m8 = quant_linear.quantize_int8_rows(torch.randn(24, 96))
    assert linear.Linear.build(m8).path == "native-int8"
    assert linear.Linear.build(m8, native=False).path == "int8"
    for rows in (1, 8, 300):
        x = torch.randn(rows, 96, generator=poisoned_io.gen(rows))
        assert torch.equal(layer(x), cpu_quant_linear.matmul(m, x))
    torch_path = QuantizedLinear.build(m, "torch")
    assert torch_path.path == "int4" and torch_path.private_bytes > 0
    x = torch.randn(5, 96, generator=poisoned_io.gen(1))
    want = x.double() @ _dense4(q, scale, offset).t()
    torch.testing.assert_close(torch_path(x).double(), want, rtol=1e-5, atol=1e-5)
