"""Linear layers with weights packed once at load, on CPU.

Why: a decode step multiplies a few dozen token rows by every weight matrix, which makes its GEMMs
bound by reading the weights. ``F.linear`` (MKL ``sgemm``) repacks the weight matrix into its
blocked layout on every call, so each weight is read, written and read again per step. Two packed
paths read only a copy laid out for them, made once here:

- fp32 where the native library's AVX-512 or AVX2 build is loaded (``cpu_linear.preferred()``):
  ``kernels/cpu/linear.py`` (``csrc/linear.c``), 32-column panels streamed at the memory's rate,
  ahead of oneDNN's prepacked linear at a decode step's rows on both builds (``bench/dense_bench.py``
  compares them side by side; docs/kernels.md, "Linear layers", has the figures).
- otherwise (bf16, the baseline x86-64 build, or no native library): oneDNN's prepacked linear
  (``torch.ops.mkldnn._reorder_linear_weight`` once, then ``torch.ops.mkldnn._linear_pointwise``:
  what inductor's weight freezing emits on CPU), which reads only its packed copy where
  ``F.linear`` repacks on every call (docs/benchmarks.md, "Measurements behind smaller choices").
  MKL's own packed GEMM (``_mkl_linear``) was not used: it only uses the packed weight when
  the row count equals the one it was packed for, so with a step's varying batch it silently falls
  back to ``F.linear``.

A quantized matrix (``pagedkv.kernels.quant_linear.QuantizedMatrix``: int4 groups, int8 rows or a GGUF's
Q4_K / Q6_K blocks) runs the native int4 / int8 / K-quant kernels on its integers where the library
is loaded (``native-int4`` / ``native-int8`` / ``native-kquant``: a decode step's rows read the
integers where they lie, ``kernels/cpu/quant_linear.py``), else PyTorch's weight-packed matmuls
(``int4`` / ``int8``; ``kquant``: a private fp32 copy, PyTorch having no K-quant operator), fp32 in
and out.

Everything else (CUDA, other dtypes, a torch without oneDNN, a failure to pack) keeps ``F.linear``.
Results equal ``F.linear``'s up to fp32 summation order (tests/kernels/cpu/test_linear.py,
tests/worker_svc/test_cpu_backend_model.py); greedy tokens stay those of transformers
(tests/worker_svc/test_model_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedkv.kernels.cpu import linear as cpu_linear
from pagedkv.kernels.cpu import quant_linear as cpu_quant_linear
from pagedkv.kernels.cpu.linear import PackedLinear
from pagedkv.kernels.cpu.quant_linear import NativeMatmul
from pagedkv.kernels.quant_linear import QuantizedLinear, QuantizedMatrix

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packing_enabled(weight: torch.Tensor) -> bool:
    """Whether ``weight`` gets a oneDNN-packed copy (when the native path does not take it): CPU,
    fp32/bf16, a torch built with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@dataclass(slots=True)
class Linear:
    """``y = x @ weight.T + bias`` through the native packed layer, a oneDNN-packed weight, or
    ``F.linear``: whichever ``build`` could make, in that order."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # oneDNN tensor (opaque layout), or None
    native: PackedLinear | None = None  # the native packed layer (fp32), or None
    quantized: QuantizedMatrix | None = None  # integer weights (then ``weight`` is their qweight)
    qlinear: QuantizedLinear | None = None  # the kernel that multiplies by them

    @classmethod
    def build(
        cls,
        weight: torch.Tensor | QuantizedMatrix,
        bias: torch.Tensor | None = None,
        *,
        native: bool | None = None,
    ) -> Linear:
        """The best path that applies. ``native``: None (the default) takes the native kernels where
        they are the faster path (integer weights always; fp32 on ``cpu_linear.preferred()``), True
        takes them wherever they load and False never (benchmarks compare the paths)."""
        if isinstance(weight, QuantizedMatrix):
            qlinear = QuantizedLinear.build(weight, "torch" if native is False else "auto")
            return cls(weight.qweight, bias, quantized=weight, qlinear=qlinear)
        weight = weight.contiguous()
        use_native = cpu_linear.preferred() if native is None else native
        layer = PackedLinear.pack(weight, bias) if use_native else None
        if layer is not None:
            return cls(weight, bias, None, layer)
        packed = None
        if packing_enabled(weight):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            except RuntimeError:  # a build without the op: plain F.linear
                packed = None
        return cls(weight, bias, packed)

    @property
    def path(self) -> str:
        """Which implementation runs: ``native-int4``, ``native-int8``, ``native-kquant``, ``int4``,
        ``int8`` (PyTorch's integer matmuls), ``kquant`` (an fp32 copy), ``native``, ``onednn`` or
        ``torch``."""
        if self.qlinear is not None:
            return self.qlinear.path
        return "native" if self.native is not None else "onednn" if self.packed is not None else "torch"

    def native_projection(self) -> tuple[PackedLinear | NativeMatmul, torch.Tensor | None] | None:
        """The native kernel this layer runs with the bias to add after it (a packed fp32 layer adds
        its own), or None when it runs another path: what a decode chain
        (kernels/cpu/decode_layers.py) calls in its place."""
        if self.qlinear is not None:
            return (self.qlinear.native, self.bias) if self.qlinear.native is not None else None
        return (self.native, None) if self.native is not None else None

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights this layer reads (integers and scales when quantized, plus the bias)."""
        bias = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        if self.quantized is not None:
            return self.quantized.nbytes + bias
        return self.weight.numel() * self.weight.element_size() + bias

    def __call__(self, x: torch.Tensor, prefill_rows: int | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``. ``prefill_rows``: None, the integer kernels choose each call's
        arithmetic by its row count; else rows ``[0, prefill_rows)`` of ``x`` are a prefill's and take
        the many-row arithmetic, the rest are decode (or verification) rows and take the one-row
        arithmetic, each at any row count (``cpu_quant_linear.ARITH_*``), so that a decode row's
        result is the same bits whatever else its step holds: the model passes it (where a kernel has
        one arithmetic for both, ``NativeMatmul.one_arithmetic``, a mixed step is one call). The
        packed fp32 kernel needs no telling (each output one sum over k, the same in every
        register tile)."""
        if self.qlinear is not None:
            y = self._quantized(x, prefill_rows)
            return y if self.bias is None else y.add_(self.bias)
        if x.dtype != self.weight.dtype or x.shape[0] == 0 or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        if self.native is not None:
            return self.native(x if x.stride(1) == 1 else x.contiguous())
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.packed, self.bias, "none", [None], ""
            )
        return F.linear(x, self.weight, self.bias)

    def _quantized(self, x: torch.Tensor, prefill_rows: int | None) -> torch.Tensor:
        qlinear = self.qlinear
        assert qlinear is not None
        if prefill_rows is None:
            return qlinear(x)
        rows = x.shape[0]
        if prefill_rows <= 0:
            return qlinear(x, arith=cpu_quant_linear.ARITH_ROWS)
        if prefill_rows >= rows:
            return qlinear(x, arith=cpu_quant_linear.ARITH_PANELS)
        if qlinear.native is not None and qlinear.native.one_arithmetic():
            return qlinear(x, arith=cpu_quant_linear.ARITH_ROWS)  # one call: the weights read once
        # A step of prefill and decode rows: two calls (the weights read twice) rather than one
        # arithmetic for both, which would make a decode row's bits depend on the prefill beside it.
        y = torch.empty((rows, qlinear.matrix.out_features), dtype=torch.float32, device=x.device)
        qlinear(x[:prefill_rows], y[:prefill_rows], cpu_quant_linear.ARITH_PANELS)
        qlinear(x[prefill_rows:], y[prefill_rows:], cpu_quant_linear.ARITH_ROWS)
        return y
