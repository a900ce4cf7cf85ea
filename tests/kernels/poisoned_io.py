"""NaN-poisoned buffers around a native linear kernel's input and output, shared by the int4 / int8
and the K-quant kernel tests: a kernel that reads past its input's columns or writes past its
output's turns NaN into a result or leaves a neighbour changed."""

from __future__ import annotations

import torch

from pagedkv.kernels.cpu import quant_linear as cpu_quant_linear
from pagedkv.kernels.quant_linear import QuantizedMatrix


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def poisoned_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    """``[rows, cols]`` random rows, a view into a buffer whose other columns are NaN."""
    buf = torch.full((rows, cols + 7), float("nan"))
    buf[:, 3 : 3 + cols] = torch.randn((rows, cols), generator=gen(seed))
    return buf[:, 3 : 3 + cols]


def run(m: QuantizedMatrix, x: torch.Tensor) -> torch.Tensor:
    """The kernel into a NaN-filled view of a wider buffer; the columns around it stay NaN."""
    rows, n = x.shape[0], m.out_features
    buf = torch.full((rows, n + 5), float("nan"))
    y = cpu_quant_linear.matmul(m, x, out=buf[:, 2 : 2 + n])
    assert y.data_ptr() == buf[:, 2:].data_ptr()
    assert torch.isnan(buf[:, :2]).all() and torch.isnan(buf[:, 2 + n :]).all()
    assert torch.isfinite(y).all()
    return y
