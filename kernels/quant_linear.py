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
  ``W = q * s``. Formats with per-group scales (GGUF's Q8_0, Q5_*) are requantized to it once
  at load, with the error measured (docs/kernels.md).
- ``kquant``: GGUF's Q4_K and Q6_K super-blocks exactly as the file holds them (256 weights in 144
  / 210 bytes: 4.5 / 6.56 bits a weight), rows one after another: ``qweight`` uint8
  ``[bytes]`` (1-D), ``qscale`` int32 ``[segments, 2]``, each segment a run of rows of one type
  (``(GGML type id, rows)``: a fused matrix may join Q4_K and Q6_K parts). The file's bytes, so
  ``dequantize`` is the gguf package's own (``kquant_dequantize``) and nothing is converted.

Which kernel (``QuantizedLinear``): the native ones (``kernels/cpu/quant_linear.py``,
``csrc/quant_linear.c``) when the library is loaded, at every row count (they are ahead of
PyTorch's operators at each row count benchmarked, docs/kernels.md). Without the native
library, PyTorch's weight-packed matmuls (``_weight_int8pack_mm`` on the same int8 bytes;
``_weight_int4pack_mm_for_cpu`` on a private copy in its own layout, made once; PyTorch has no
K-quant operator, so ``kquant`` then multiplies a private fp32 copy). ``python -m bench.decode_floor``
compares the two side by side (docs/benchmarks.md).

Pure functions on tensors: the model decides which form each matrix takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from pagedkv.arith import ceil_div
from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kernels.cpu import quant_linear as cpu_quant_linear

GROUP = 32  # inputs per int4 scale/offset group: GGUF's block (and the K-quants' sub-block) size
PANEL = 16  # output rows per int4 panel
CHUNK = GROUP * PANEL // 2  # nibble bytes per (panel, group)
TORCH_ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu's requirement on the output rows
KQ_BLOCK = 256  # weights per K-quant super-block
KQUANT_TYPES = {"Q4_K": 12, "Q6_K": 14}  # the K-quant types held as they are -> GGML type id
KQ_BLOCK_BYTES = {12: 144, 14: 210}  # GGML type id -> bytes per super-block

Path = Literal["auto", "native", "torch"]


def int4_shapes(out_features: int, in_features: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The shapes of an int4 matrix's ``qweight`` (uint8) and ``qscale`` (fp32)."""
    panels, groups = ceil_div(out_features, PANEL), in_features // GROUP
    return (panels, groups, CHUNK), (panels, groups, 2 * PANEL)


def kquant_shapes(segments: list[tuple[str, int]], in_features: int) -> tuple[tuple[int], tuple[int, int]]:
    """The shapes of a kquant matrix's ``qweight`` (uint8) and ``qscale`` (int32) for row segments
    ``(GGUF type name, rows)``."""
    blocks = in_features // KQ_BLOCK
    nbytes = sum(rows * blocks * KQ_BLOCK_BYTES[KQUANT_TYPES[t]] for t, rows in segments)
    return (nbytes,), (len(segments), 2)


def kquant_in_features(qweight: torch.Tensor, qscale: torch.Tensor) -> int:
    """A kquant matrix's inputs: its bytes over the bytes one super-block column takes (0 when the
    segments name no rows or an unknown type)."""
    per_block = sum(int(r) * KQ_BLOCK_BYTES.get(int(t), 0) for t, r in qscale.tolist())
    return int(qweight.numel()) // per_block * KQ_BLOCK if per_block else 0


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
        if self.qweight.dtype is torch.uint8:
            return "kquant" if self.qweight.dim() == 1 else "int4"
        return "int8"

    @property
    def in_features(self) -> int:
        if self.kind == "kquant":
            return kquant_in_features(self.qweight, self.qscale)
        return int(self.qweight.shape[1]) * (GROUP if self.kind == "int4" else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.qscale))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` fp32 ``[rows, in]`` -> fp32 ``[rows, out]`` (a model builds its
        ``QuantizedLinear`` once instead: without the native library, int4 makes a private copy)."""
        return QuantizedLinear.build(self)(x)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``W[ids]`` (an embedding lookup); int8 or kquant (the int4 layout is in panels)."""
        if self.kind == "kquant":
            return (
                cpu_quant_linear.kquant_rows(self, ids) if cpu_native.available() else _kquant_rows(self, ids)
            )
        if self.kind != "int8":
            raise ValueError("row lookup needs the int8 form (or kquant)")
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
        if self.kind == "kquant":
            return kquant_dequantize(self)
        q, scale, offset = self.unpack_int4()
        s, z = scale.repeat_interleave(GROUP, 1), offset.repeat_interleave(GROUP, 1)
        return (q.to(torch.float32) - 8) * s + z


@dataclass(slots=True, frozen=True)
class QuantizedLinear:
    """``y = x @ W.T`` over a ``QuantizedMatrix``, by the kernel ``path`` names (``build`` chooses)."""

    matrix: QuantizedMatrix
    native: cpu_quant_linear.NativeMatmul | None  # the native kernels; None: PyTorch's operators
    torch_int4: tuple[torch.Tensor, torch.Tensor] | None = None  # int4 in torch's layout (torch path)
    torch_dense: torch.Tensor | None = None  # kquant dequantized to fp32 (torch path: no K-quant op)

    @classmethod
    def build(cls, m: QuantizedMatrix, path: Path = "auto") -> QuantizedLinear:
        """``auto``: native when the library is loaded, else torch; ``native`` / ``torch`` force one
        (benchmarks and tests compare them). ``native`` without the library raises RuntimeError."""
        if path not in ("auto", "native", "torch"):
            raise ValueError(f"path must be auto, native or torch, got {path!r}")
        native = cpu_native.available() if path == "auto" else path == "native"
        if native and not cpu_native.available():
            raise RuntimeError(
                "the native kernels are not loaded (kernels/cpu/native.py says why in the log)"
            )
        if native:
            return cls(m, cpu_quant_linear.prepare(m))
        if m.kind == "kquant":
            return cls(m, None, None, kquant_dequantize(m))
        return cls(m, None, None if m.kind == "int8" else _torch_int4(m))

    @property
    def path(self) -> str:
        """``native-int4`` / ``native-int8`` / ``native-kquant``, or ``int4`` / ``int8`` / ``kquant``
        for PyTorch's operators (kquant: ``F.linear`` on a private fp32 copy)."""
        return f"native-{self.matrix.kind}" if self.native is not None else self.matrix.kind

    @property
    def private_bytes(self) -> int:
        """Bytes held beside the matrix (torch's int4 copy, kquant's fp32 one), counted nowhere else."""
        dense = self.torch_dense.numel() * 4 if self.torch_dense is not None else 0
        return dense + (sum(t.numel() * t.element_size() for t in self.torch_int4) if self.torch_int4 else 0)

    def __call__(
        self, x: torch.Tensor, out: torch.Tensor | None = None, arith: int = cpu_quant_linear.ARITH_AUTO
    ) -> torch.Tensor:
        """``x`` fp32 ``[rows, in]`` -> fp32 ``[rows, out]`` (into ``out`` when given). ``arith``: the
        native kernels' arithmetic for the rows (``cpu_quant_linear.ARITH_*``); PyTorch's operators
        have one arithmetic whatever it says."""
        native, m = self.native, self.matrix
        k = native.k if native is not None else m.in_features  # read once: a decode step makes ~120 calls
        if not (
            isinstance(x, torch.Tensor) and x.dtype is torch.float32 and x.dim() == 2 and x.shape[1] == k
        ):
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be fp32 [rows, {k}], got {got}")
        if native is not None:
            return native(x if x.stride(1) == 1 else x.contiguous(), out, arith)
        y = self._torch(x.contiguous())
        if out is None:
            return y
        out.copy_(y)
        return out

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        """PyTorch's operators on ``x`` (dense)."""
        m = self.matrix
        y: torch.Tensor
        if m.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, m.qweight, m.qscale)
            return y
        if self.torch_dense is not None:
            return torch.nn.functional.linear(x, self.torch_dense)
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


def pack_kquant(parts: list[tuple[str, torch.Tensor]]) -> QuantizedMatrix:
    """Row segments ``(GGUF type name, uint8 [rows, row_bytes] super-blocks)``, all of the same
    inputs, as one kquant matrix: their bytes one after another (copied once), nothing converted."""
    if not parts:
        raise ValueError("a kquant matrix needs at least one row segment")
    in_features = -1
    for type_name, raw in parts:
        if type_name not in KQUANT_TYPES:
            raise ValueError(f"{type_name} is not held as kquant; kquant types: {', '.join(KQUANT_TYPES)}")
        size = KQ_BLOCK_BYTES[KQUANT_TYPES[type_name]]
        if raw.dtype is not torch.uint8 or raw.dim() != 2 or raw.shape[1] % size or raw.shape[1] == 0:
            raise ValueError(
                f"{type_name} rows must be uint8 [rows, a multiple of {size}], "
                f"got {raw.dtype} {tuple(raw.shape)}"
            )
        cols = raw.shape[1] // size * KQ_BLOCK
        if in_features not in (-1, cols):
            raise ValueError(f"the segments have different inputs ({in_features} and {cols})")
        in_features = cols
    qweight = torch.cat([raw.reshape(-1) for _, raw in parts]).contiguous()
    qscale = torch.tensor([[KQUANT_TYPES[t], raw.shape[0]] for t, raw in parts], dtype=torch.int32)
    return QuantizedMatrix(qweight, qscale, sum(int(raw.shape[0]) for _, raw in parts))


def kquant_segments(m: QuantizedMatrix) -> list[tuple[str, torch.Tensor]]:
    """A kquant matrix's row segments ``(GGUF type name, uint8 [rows, row_bytes])``, views of ``qweight``."""
    names = {v: k for k, v in KQUANT_TYPES.items()}
    blocks = m.in_features // KQ_BLOCK
    out, at = [], 0
    for t, rows in m.qscale.tolist():
        row_bytes = blocks * KQ_BLOCK_BYTES[int(t)]
        out.append((names[int(t)], m.qweight[at : at + rows * row_bytes].view(rows, row_bytes)))
        at += rows * row_bytes
    return out


def kquant_dequantize(m: QuantizedMatrix) -> torch.Tensor:
    """The fp32 matrix of a kquant matrix, by the gguf package's own dequantization."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    parts = []
    for name, raw in kquant_segments(m):
        w = np.asarray(dequantize(raw.numpy(), GGMLQuantizationType[name]), dtype=np.float32)
        parts.append(torch.from_numpy(w.reshape(raw.shape[0], m.in_features)))
    return torch.cat(parts)


def _kquant_rows(m: QuantizedMatrix, ids: torch.Tensor) -> torch.Tensor:
    """Row lookup without the native library: the looked-up rows' blocks, dequantized."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out = torch.empty((ids.numel(), m.in_features), dtype=torch.float32)
    first = 0
    for name, raw in kquant_segments(m):
        rows = raw.shape[0]
        hit = ((ids >= first) & (ids < first + rows)).nonzero().flatten()
        if hit.numel():
            blocks = raw.index_select(0, ids[hit] - first).numpy()
            w = np.asarray(dequantize(blocks, GGMLQuantizationType[name]), dtype=np.float32)
            out[hit] = torch.from_numpy(w.reshape(hit.numel(), m.in_features))
        first += rows
    return out
