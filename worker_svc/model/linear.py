"""Linear layers with weights prepacked once at load for oneDNN, on CPU.

Why: a decode step multiplies a few dozen token rows by every weight matrix, which makes its GEMMs
bound by reading the weights. ``F.linear`` (MKL ``sgemm``) repacks the weight matrix into its
blocked layout on every call, so each weight is read, written and read again per step. oneDNN's
prepacked linear (``torch.ops.mkldnn._reorder_linear_weight`` once at load, then
``torch.ops.mkldnn._linear_pointwise``: what inductor's weight freezing emits on CPU) reads only the
packed copy. Measured on these 2-core hosts (best of 15, shared machine): hidden 1024 -> 3072 at 16
and 64 rows 1.2-2.3x faster than ``F.linear``, the 32000-row output layer 1.1-1.4x; at 256+ rows
(prefill-heavy steps) within noise of ``F.linear``. MKL's own packed GEMM (``_mkl_linear``) was not
used: it only uses the packed weight when the row count equals the one it was packed for, so with
a step's varying batch it silently falls back to ``F.linear``.

Used wherever it applies (CPU, fp32 or bf16, a torch built with oneDNN); everything else, and any
failure to pack, keeps ``F.linear``.
Results equal ``F.linear``'s up to fp32 summation order (tests/worker_svc/test_cpu_backend_model.py);
greedy tokens stay those of transformers (tests/worker_svc/test_model_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packing_enabled(weight: torch.Tensor) -> bool:
    """Whether ``weight`` gets a oneDNN-packed copy: CPU, fp32/bf16, a torch built with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@dataclass(slots=True)
class Linear:
    """``y = x @ weight.T + bias`` with an optional prepacked weight."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # oneDNN tensor (opaque layout), or None: F.linear

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        weight = weight.contiguous()
        packed = None
        if packing_enabled(weight):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            except RuntimeError:  # a build without the op: plain F.linear
                packed = None
        return cls(weight, bias, packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dtype != self.weight.dtype or x.shape[0] == 0:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [None], "")
