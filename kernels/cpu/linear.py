"""The fp32 linear layer on CPU over weights packed once at load (``csrc/linear.c``).

Why: a decode step's GEMMs multiply a few dozen rows by every weight matrix, so they are bound by
reading the weights. Packed into 32-column panels, each read front to back, the weights stream at
the memory's rate: on SmolLM2-135M's shape it is ahead of oneDNN's prepacked linear at a decode
step's few rows and level with it at a prefill's hundreds (``bench/dense_bench.py`` measures both
side by side; docs/kernels.md, "Linear layers", has the figures).

Its register tile follows the variant's vector registers (AVX-512: 8 rows x 2 vectors of 16 floats;
AVX2: 3 rows x 4 vectors of 8), so that every accumulator has a register of its own: the AVX-512
tile compiled for AVX2 keeps its accumulators on the stack and falls far behind oneDNN, while with
its own tile the AVX2 build is ahead of it. The model uses it (``worker_svc/model/linear.py``) where
``preferred()`` says so: the loaded variant is one ``bench/dense_bench.py`` found ahead of oneDNN.
Elsewhere (the baseline x86-64 build, whose 16 SSE registers of 4 floats cannot hold the AVX2 tile)
fp32 layers take oneDNN's prepacked linear.

Called through ctypes, as the fused layer operations are (``kernels/cpu/layer_ops.py`` says why):
about 150 calls a step on a 30-layer model. ``x`` is checked before any pointer is used
(``ValueError`` naming the problem); the packed weight was checked when it was packed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.kernels.cpu import native as cpu_native

# The variants whose build of csrc/linear.c beats oneDNN (bench/dense_bench.py, side by side).
FASTER_THAN_ONEDNN = frozenset({"avx512", "avx2"})


def preferred() -> bool:
    """Whether the model's fp32 layers should take this kernel rather than oneDNN's: the loaded
    native variant is one of ``FASTER_THAN_ONEDNN``."""
    return cpu_native.active_variant() in FASTER_THAN_ONEDNN


@dataclass(slots=True, frozen=True)
class PackedLinear:
    """``y = x @ weight.T + bias`` for fp32 CPU rows, ``weight`` ([out, in]) held packed in panels."""

    lib: Any  # the ctypes library (kernels/cpu/native.py sets the functions' argument types)
    packed: torch.Tensor  # flat fp32: ceil(out / 32) panels of [in][32], zero padded
    out_features: int
    in_features: int
    bias: torch.Tensor | None

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear | None:
        """The packed layer, or None when it does not apply (the native library is not loaded, or
        ``weight`` is not a 2-D fp32 CPU tensor): the caller then keeps another path."""
        lib = cpu_native.library()
        if lib is None or not _fp32_cpu(weight) or weight.dim() != 2 or weight.stride(1) != 1:
            return None
        if bias is not None and (not _fp32_cpu(bias) or bias.shape != (weight.shape[0],)):
            raise ValueError(
                f"bias must be an fp32 CPU tensor of shape ({weight.shape[0]},), got "
                f"{bias.dtype} {tuple(bias.shape)} on {bias.device}"
            )
        out_features, in_features = weight.shape
        packed = torch.empty(lib.pagedkv_linear_packed_numel(out_features, in_features), dtype=torch.float32)
        if packed.numel():
            lib.pagedkv_linear_pack_f32(
                out_features,
                in_features,
                weight.data_ptr(),
                weight.stride(0),
                packed.data_ptr(),
                torch.get_num_threads(),
            )
        return cls(lib, packed, out_features, in_features, bias.contiguous() if bias is not None else None)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[rows, in]`` -> ``[rows, out]``, into ``out`` when given (else a new tensor). Rows of
        ``x`` and ``out`` may be strided; their columns must be dense."""
        _rows("x", x)
        rows, width = x.shape
        if width != self.in_features:
            raise ValueError(f"x has {width} columns, the layer takes {self.in_features}")
        if out is None:
            y = torch.empty((rows, self.out_features), dtype=torch.float32)
        else:
            _rows("out", out)
            if out.shape != (rows, self.out_features):
                raise ValueError(f"out must be [{rows}, {self.out_features}], got {list(out.shape)}")
            if rows > 1 and out.stride(0) < self.out_features:
                raise ValueError(f"out's rows overlap (row stride {out.stride(0)})")
            if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
                raise ValueError("out must not share memory with x")
            y = out
        if rows and self.out_features:
            self.lib.pagedkv_linear_f32(
                rows,
                self.out_features,
                width,
                x.data_ptr(),
                x.stride(0),
                self.packed.data_ptr(),
                self.bias.data_ptr() if self.bias is not None else None,
                y.data_ptr(),
                y.stride(0),
                torch.get_num_threads(),
            )
        return y


def _fp32_cpu(t: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cpu and t.dtype is torch.float32


def _rows(name: str, t: torch.Tensor) -> None:
    """``t``: a 2-D fp32 CPU tensor whose columns are dense."""
    if not _fp32_cpu(t) or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(
            f"{name} must be a 2-D fp32 CPU tensor with dense columns, got "
            f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))} "
            f"strides {t.stride() if isinstance(t, torch.Tensor) else None}"
        )
