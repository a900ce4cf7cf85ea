"""Linear layers with weights prepacked once at load, for fp32 on CPU.

Why: a decode step multiplies a few dozen token rows by every weight matrix, which makes the GEMMs
bound by reading the weights. ``F.linear`` (MKL ``sgemm``) repacks the weight matrix into its
blocked layout on every call, so each weight is read, written and read again per step. MKL's packed
GEMM (``torch.ops.mkl._mkl_linear``, what inductor's weight freezing emits on CPU) packs each weight
once at load and reads only the packed copy afterwards.

Used only where it applies (CPU, fp32, a torch built with MKL); everything else, and any failure to
pack, keeps ``F.linear``. ``PAGEDKV_PACKED_LINEAR=0`` turns packing off (e.g. to compare). Results
equal ``F.linear``'s up to fp32 summation order (tests/worker_svc/test_linear.py); greedy tokens stay
those of transformers (tests/worker_svc/test_model_runner.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ENV_VAR = "PAGEDKV_PACKED_LINEAR"
# MKL's pack takes a row-count hint; any row count works afterwards (it only tunes the blocking).
PACK_ROWS_HINT = 64


def packing_enabled(weight: torch.Tensor) -> bool:
    """Whether ``weight`` gets an MKL-packed copy: CPU, fp32, MKL present, not disabled."""
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


@dataclass(slots=True)
class Linear:
    """``y = x @ weight.T + bias`` with an optional prepacked weight."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        weight = weight.contiguous()
        packed = None
        if packing_enabled(weight):
            try:
                packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_ROWS_HINT)
            except RuntimeError:  # an MKL build without packed GEMM: plain F.linear
                packed = None
        return cls(weight, bias, packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] == 0:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x.contiguous(), self.packed, self.weight, self.bias, PACK_ROWS_HINT)
