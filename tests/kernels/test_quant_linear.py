"""Weight-only quantized linear layers (kernels/quant_linear.py) against float64 products of the
weights the integers stand for, through each path (the native kernels when loaded, PyTorch's
operators): odd shapes (rows padded to the 16-row panel), inputs read from NaN-poisoned buffers,
padded rows poisoned, the packing unpacked to the same integers, and a wrong scale or group index
caught. The native kernels' own oracles: tests/kernels/cpu/test_quant_linear.py."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import quant_linear
from pagedkv.kernels.cpu.quant_linear import INPUT_ROUNDING
from pagedkv.kernels.quant_linear import GROUP, PANEL, QuantizedLinear, QuantizedMatrix
from tests.kernels import kquant_cases

PATHS = ["auto", "torch"]


def _int4(out_f: int, in_f: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.uint8)
    scale = 0.01 + 0.05 * torch.rand((out_f, in_f // GROUP), generator=g)
    offset = 0.2 * torch.randn((out_f, in_f // GROUP), generator=g)
    return q, scale, offset


def _dense(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    s, z = scale.repeat_interleave(GROUP, 1), offset.repeat_interleave(GROUP, 1)
    return (q.double() - 8) * s.double() + z.double()


def _poisoned_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    """``[rows, cols]`` random rows, a view into a buffer whose other columns are NaN."""
    buf = torch.full((rows, cols + 7), float("nan"))
    buf[:, 3 : 3 + cols] = torch.randn((rows, cols), generator=torch.Generator().manual_seed(seed))
    return buf[:, 3 : 3 + cols]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("out_f", "in_f", "rows"), [(40, 96, 5), (7, 32, 1), (33, 64, 17), (64, 256, 3)])
def test_int4_matches_the_float64_product_of_its_groups(path: str, out_f: int, in_f: int, rows: int) -> None:
    q, scale, offset = _int4(out_f, in_f, seed=out_f)
    m = quant_linear.pack_int4(q, scale, offset)
    assert m.kind == "int4" and m.in_features == in_f and m.out_features == out_f
    assert m.qweight.shape == (-(-out_f // PANEL), in_f // GROUP, 256)  # half a byte per weight
    assert [torch.equal(a, b) for a, b in zip(m.unpack_int4(), (q, scale, offset), strict=True)] == [True] * 3
    used = out_f - (m.qscale.shape[0] - 1) * PANEL
    m.qscale[-1, :, used:PANEL] = float("nan")  # padded rows: never part of the output
    m.qscale[-1, :, PANEL + used :] = float("nan")
    x = _poisoned_rows(rows, in_f, seed=1)
    layer = QuantizedLinear.build(m, path)  # type: ignore[arg-type]
    y = layer(x)
    assert y.shape == (rows, out_f) and torch.isfinite(y).all()
    if layer.path == "native-int4":  # the kernel multiplies x rounded to 16 bits per 32 inputs
        r = INPUT_ROUNDING["int4"]
        x = kquant_cases.round_inputs_as_the_kernel_does(x, r.block, r.top)
    ref = x.double() @ _dense(q, scale, offset).t()
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(m.dequantize().double(), _dense(q, scale, offset), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_a_wrong_scale_or_group_index_is_caught(path: str) -> None:
    """The comparison above fails when one group's scale is swapped with its neighbour's, or the
    groups are shifted by one (what a packing bug would do)."""
    q, scale, offset = _int4(48, 128, seed=5)
    x = torch.randn((4, 128), generator=torch.Generator().manual_seed(2))
    ref = x.double() @ _dense(q, scale, offset).t()
    swapped = scale.clone()
    swapped[:, [0, 1]] = swapped[:, [1, 0]]
    shifted = (scale.roll(1, dims=1), offset.roll(1, dims=1))
    for s, z in ((swapped, offset), shifted):
        y = QuantizedLinear.build(quant_linear.pack_int4(q, s, z), path)(x)  # type: ignore[arg-type]
        assert not torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("out_f", "in_f"), [(7, 40), (33, 576), (128, 17)])
def test_int8_rows_match_the_float64_product_and_round_to_half_a_step(
    path: str, out_f: int, in_f: int
) -> None:
    w = torch.randn((out_f, in_f), generator=torch.Generator().manual_seed(in_f))
    m = quant_linear.quantize_int8_rows(w)
    assert m.kind == "int8" and m.qweight.dtype is torch.int8 and m.in_features == in_f
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((m.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    x = _poisoned_rows(9, in_f, seed=4)
    layer = QuantizedLinear.build(m, path)  # type: ignore[arg-type]
    y = layer(x)
    assert torch.isfinite(y).all()
    if layer.path == "native-int8":  # the kernel multiplies x rounded to 16 bits per 32 inputs
        r = INPUT_ROUNDING["int8"]
        x = kquant_cases.round_inputs_as_the_kernel_does(x, r.block, r.top)
    torch.testing.assert_close(y.double(), x.double() @ m.dequantize().double().t(), rtol=1e-4, atol=1e-4)
    ids = torch.tensor([0, out_f - 1, 0, 2 % out_f])
    torch.testing.assert_close(m.rows(ids), m.dequantize()[ids], rtol=0, atol=0)


def test_bad_arguments_are_refused_naming_the_problem() -> None:
    q, scale, offset = _int4(16, 64, seed=0)
    m = quant_linear.pack_int4(q, scale, offset)
    with pytest.raises(ValueError, match=r"fp32 \[rows, 64\]"):
        m(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"fp32 \[rows, 64\]"):
        m(torch.randn(2, 32))
    with pytest.raises(ValueError, match="positive multiple of 32"):
        quant_linear.pack_int4(q[:, :48], scale, offset)
    with pytest.raises(ValueError, match="0..15"):
        quant_linear.pack_int4(q + 16, scale, offset)
    with pytest.raises(ValueError, match=r"\[16, 2\]"):
        quant_linear.pack_int4(q, scale[:, :1], offset)
    with pytest.raises(ValueError, match="row lookup needs the int8 form"):
        m.rows(torch.tensor([0]))
    with pytest.raises(ValueError, match="int8 needs"):
        quant_linear.pack_int8(q, torch.ones(16))
    assert isinstance(m, QuantizedMatrix) and m.nbytes == 16 * 32 + 2 * 16 * 2 * 4
