"""Weight-only quantized linear layers on CPU: the integer formats, and which kernel multiplies by them.

Two forms, both ``y = x @ W.T`` with ``x`` fp32 ``[rows, in]``:

- ``int4``: 4-bit values ``q`` in 0..15 with a scale ``s`` and an offset ``z`` per group of
  ``GROUP`` (32) inputs of a row: ``W = (q - 8) * s + z``. GGUF's Q4_0, Q4_1 and Q4_K blocks are
  exactly this form (``worker_svc/model/gguf_quant.py``). Held in panels of ``PANEL`` (16) output
  rows, panel-major, so that a kernel streams its rows front to back: ``qweight`` uint8
  ``[panels, in / 32, 256]`` (for each of a group's 32 inputs 8 bytes, byte ``j`` holding row
  ``16p + j`` in its low nibble and row ``16p + j + 8`` in its high one) and ``qscale`` fp32
  ``[panels, in / 32, 32]`` (the group's 16 scales, then its 16 offsets). Half a byte a weight plus
  8 bytes a group; rows past ``out_features`` (up to the panel) are padding, never part of an output.
- ``int8``: signed 8-bit values, row-major ``[out, in]``, with one fp32 scale per output row,
  ``W = q * s``. Formats with per-group scales (GGUF's Q8_0, Q5_*, Q6_K) are requantized to it once
  at load, with the error measured (docs/kernels.md).

Which kernel (``QuantizedLinear``): the native ones (``kernels/cpu_quant_linear.py``,
``csrc/quant_linear.c``) when the library is loaded, at every row count (they were faster than
PyTorch's operators at each row count measured, docs/kernels.md). Without the native
library, PyTorch's weight-packed matmuls (``_weight_int8pack_mm`` on the same int8 bytes;
``_weight_int4pack_mm_for_cpu`` on a private copy in its own layout, made once). Measured side by
side by ``python -m bench.decode_floor`` (docs/benchmarks.md).

Pure functions on tensors: the model decides which form each matrix takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kernels import cpu_native, cpu_quant_linear

GROUP = 32  # inputs per int4 scale/offset group: GGUF's block (and the K-quants' sub-block) size
PANEL = 16  # output rows per int4 panel
CHUNK = GROUP * PANEL // 2  # nibble bytes per (panel, group)
TORCH_ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu's requirement on the output rows

Path = Literal["auto", "native", "torch"]


def int4_shapes(out_features: int, in_features: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The shapes of an int4 matrix's ``qweight`` (uint8) and ``qscale`` (fp32)."""
    panels, groups = -(-out_features // PANEL), in_features // GROUP
    return (panels, groups, CHUNK), (panels, groups, 2 * PANEL)


@dataclass(slots=True, frozen=True)
class QuantizedMatrix:
    """A matrix ``[out_features, in_features]`` held as integers (module docstring: the layouts).

    ``qweight``: uint8 ``[panels, in / GROUP, 256]`` (int4) or int8 ``[out, in]`` (int8).
    ``qscale``: fp32 ``[panels, in / GROUP, 32]`` (int4: scales and offsets) or fp32 ``[out]``
    (int8). Both may be views of a shared region: nothing here copies them."""

    qweight: torch.Tensor
    qscale: torch.Tensor
    out_features: int

    @property
    def kind(self) -> str:
        return "int4" if self.qweight.dtype is torch.uint8 else "int8"

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1]) * (GROUP if self.kind == "int4" else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.qscale))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` fp32 ``[rows, in]`` -> fp32 ``[rows, out]`` (a model builds its
        ``QuantizedLinear`` once instead: without the native library, int4 makes a private copy)."""
        return QuantizedLinear.build(self)(x)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``W[ids]`` (an embedding lookup); int8 only (the int4 layout is in panels)."""
        if self.kind != "int8":
            raise ValueError("row lookup needs the int8 form")
        return self.qweight.index_select(0, ids).to(torch.float32) * self.qscale.index_select(0, ids)[:, None]

    def unpack_int4(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int4: the integers ``q`` uint8 ``[out, in]``, ``scale``/``offset`` fp32 ``[out, in / GROUP]``."""
        if self.kind != "int4":
            raise ValueError("unpack_int4 needs the int4 form")
        panels, groups, _ = self.qweight.shape
        b = self.qweight.reshape(panels, groups, GROUP, PANEL // 2)  # [p, g, k, j]
        q = torch.cat((b & 15, b >> 4), dim=3)  # [p, g, k, row in panel]
        q = q.permute(0, 3, 1, 2).reshape(panels * PANEL, groups * GROUP)
        sz = (
            self.qscale.reshape(panels, groups, 2, PANEL)
            .permute(2, 0, 3, 1)
            .reshape(2, panels * PANEL, groups)
        )
        n = self.out_features
        return q[:n].contiguous(), sz[0, :n].contiguous(), sz[1, :n].contiguous()

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix these integers stand for (``(q - 8) * s + z`` / ``q * s`` in fp32, the
        values every kernel multiplies by; tests and error measurements, not a hot path)."""
        if self.kind == "int8":
            return self.qweight.to(torch.float32) * self.qscale[:, None]
        q, scale, offset = self.unpack_int4()
        s, z = scale.repeat_interleave(GROUP, 1), offset.repeat_interleave(GROUP, 1)
        return (q.to(torch.float32) - 8) * s + z


@dataclass(slots=True, frozen=True)
class QuantizedLinear:
    """``y = x @ W.T`` over a ``QuantizedMatrix``, by the kernel ``path`` names (``build`` chooses)."""

    matrix: QuantizedMatrix
    native: cpu_quant_linear.NativeMatmul | None  # the native kernels; None: PyTorch's operators
    torch_int4: tuple[torch.Tensor, torch.Tensor] | None = None  # int4 in torch's layout (torch path)

    @classmethod
    def build(cls, m: QuantizedMatrix, path: Path = "auto") -> QuantizedLinear:
        """``auto``: native when the library is loaded, else torch; ``native`` / ``torch`` force one
        (benchmarks and tests compare them). ``native`` without the library raises RuntimeError."""
        if path not in ("auto", "native", "torch"):
            raise ValueError(f"path must be auto, native or torch, got {path!r}")
        native = cpu_native.available() if path == "auto" else path == "native"
        if native and not cpu_native.available():
            raise RuntimeError(
                "the native kernels are not loaded (kernels/cpu_native.py says why in the log)"
            )
        if native:
            return cls(m, cpu_quant_linear.prepare(m))
        return cls(m, None, None if m.kind == "int8" else _torch_int4(m))

    @property
    def path(self) -> str:
        """``native-int4`` / ``native-int8``, or ``int4`` / ``int8`` for PyTorch's operators."""
        return f"native-{self.matrix.kind}" if self.native is not None else self.matrix.kind

    @property
    def private_bytes(self) -> int:
        """Bytes held beside the matrix (torch's int4 copy), counted nowhere else."""
        return sum(t.numel() * t.element_size() for t in self.torch_int4) if self.torch_int4 else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` fp32 ``[rows, in]`` -> fp32 ``[rows, out]``."""
        m = self.matrix
        if x.dtype is not torch.float32 or x.dim() != 2 or x.shape[1] != m.in_features:
            raise ValueError(f"x must be fp32 [rows, {m.in_features}], got {x.dtype} {tuple(x.shape)}")
        if self.native is not None:
            return self.native(x if x.stride(1) == 1 else x.contiguous())
        x = x.contiguous()
        y: torch.Tensor
        if m.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, m.qweight, m.qscale)
            return y
        assert self.torch_int4 is not None
        packed, sz = self.torch_int4
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)
        return y if y.shape[1] == m.out_features else y[:, : m.out_features].contiguous()


def _torch_int4(m: QuantizedMatrix) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 matrix in ``_convert_weight_to_int4pack_for_cpu``'s layout (which depends on the CPU
    torch runs on) and ``[in / GROUP, rows, 2]`` scales and offsets, rows padded to 16."""
    q, scale, offset = m.unpack_int4()
    pad = -m.out_features % TORCH_ROW_MULTIPLE
    q32 = torch.nn.functional.pad(q.to(torch.int32), (0, 0, 0, pad))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32, 1)
    sz = torch.stack((scale, offset), dim=-1)
    sz = torch.nn.functional.pad(sz, (0, 0, 0, 0, 0, pad)).transpose(0, 1).contiguous()
    return packed, sz


def pack_int4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> QuantizedMatrix:
    """``q`` integers 0..15 ``[out, in]``, ``scale``/``offset`` fp32 ``[out, in / GROUP]``: the
    packed int4 matrix ``W = (q - 8) * scale + offset`` (per group of GROUP inputs)."""
    out_features, in_features = q.shape
    if in_features % GROUP or in_features == 0:
        raise ValueError(f"int4 needs in_features a positive multiple of {GROUP}, got {in_features}")
    groups = in_features // GROUP
    if scale.shape != (out_features, groups) or offset.shape != (out_features, groups):
        raise ValueError(
            f"scale and offset must be [{out_features}, {groups}], "
            f"got {tuple(scale.shape)}, {tuple(offset.shape)}"
        )
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("int4 values must lie in 0..15")
    (panels, _, _), _ = int4_shapes(out_features, in_features)
    pad = panels * PANEL - out_features
    qp = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad)).reshape(panels, PANEL, groups, GROUP)
    byte = qp[:, : PANEL // 2] | (qp[:, PANEL // 2 :] << 4)  # [p, j, g, k]
    qweight = byte.permute(0, 2, 3, 1).reshape(panels, groups, CHUNK).contiguous()
    sz = torch.stack((scale, offset)).to(torch.float32)  # [2, out, groups]
    sz = torch.nn.functional.pad(sz, (0, 0, 0, pad)).reshape(2, panels, PANEL, groups)
    qscale = sz.permute(1, 3, 0, 2).reshape(panels, groups, 2 * PANEL).contiguous()
    return QuantizedMatrix(qweight, qscale, out_features)


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> QuantizedMatrix:
    """``q`` int8 ``[out, in]`` and one fp32 scale per row: ``W = q * scale[:, None]``."""
    if q.dtype is not torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
        raise ValueError(
            f"int8 needs int8 [out, in] values and [out] scales, "
            f"got {q.dtype} {tuple(q.shape)}, {tuple(scale.shape)}"
        )
    return QuantizedMatrix(q.contiguous(), scale.to(torch.float32).contiguous(), int(q.shape[0]))


def quantize_int8_rows(w: torch.Tensor) -> QuantizedMatrix:
    """Round an fp32 matrix to int8 with one scale per row (absolute maximum / 127)."""
    w = w.to(torch.float32)
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return pack_int8(q, scale)
