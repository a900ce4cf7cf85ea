"""Weight-only quantized linear layers on CPU: PyTorch's weight-packed matmuls, over integer weights.

Why these operators: they are maintained in PyTorch (torchao's CPU int4/int8 weight-only paths
call them), take fp32 activations, and read the weights in their packed integer form, so a
quantized model is held and read at about its file's size instead of 4-8x more as fp32.

Two forms, both ``y = x @ W.T`` with ``x`` fp32 ``[rows, in]``:

- ``int4``: 4-bit values ``q`` in 0..15 with a scale ``s`` and an offset ``z`` per group of
  ``GROUP`` (32) inputs of a row: ``W = (q - 8) * s + z`` (the convention of
  ``torch.ops.aten._weight_int4pack_mm_for_cpu``). Packed once with
  ``_convert_weight_to_int4pack_for_cpu`` (a blocked layout of the CPU build: half a byte per
  weight), the scales and offsets as one ``[in / GROUP, out, 2]`` fp32 tensor. The operator wants a
  row count divisible by 16: other counts are padded with zero rows at packing and the output
  sliced. GGUF's Q4_0, Q4_1 and Q4_K blocks are exactly this form (``worker_svc/model/gguf_quant.py``).
- ``int8``: signed 8-bit values with one fp32 scale per output row, ``W = q * s``
  (``torch.ops.aten._weight_int8pack_mm``). The operator has no per-group scales, so formats with
  them (GGUF's Q8_0, Q5_*, Q6_K) are requantized to it once at load, with the error measured
  (docs/kernels.md).

Pure functions on tensors: the model decides which form each matrix takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # inputs per int4 scale/offset group: GGUF's block (and the K-quants' sub-block) size
ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu's requirement on the output rows


@dataclass(slots=True, frozen=True)
class QuantizedMatrix:
    """A matrix ``[out_features, in_features]`` held as integers.

    ``qweight``: uint8 ``[padded_out, in / 2]`` (int4, the operator's packed layout) or int8
    ``[out, in]`` (int8). ``qscale``: fp32 ``[in / GROUP, padded_out, 2]`` (int4: scale and offset)
    or fp32 ``[out]`` (int8). Both may be views of a shared region: nothing here copies them."""

    qweight: torch.Tensor
    qscale: torch.Tensor
    out_features: int

    @property
    def kind(self) -> str:
        return "int4" if self.qweight.dtype is torch.uint8 else "int8"

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1]) * (2 if self.kind == "int4" else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.qscale))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` fp32 ``[rows, in]`` -> fp32 ``[rows, out]``."""
        if x.dtype is not torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be fp32 [rows, {self.in_features}], got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        y: torch.Tensor
        if self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.qscale)
            return y
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, GROUP, self.qscale)
        return y if y.shape[1] == self.out_features else y[:, : self.out_features].contiguous()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``W[ids]`` (an embedding lookup); int8 only (the int4 layout is blocked)."""
        if self.kind != "int8":
            raise ValueError("row lookup needs the int8 form")
        return self.qweight.index_select(0, ids).to(torch.float32) * self.qscale.index_select(0, ids)[:, None]

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix these integers stand for (tests and error measurements; not a hot path)."""
        if self.kind == "int8":
            return self.qweight.to(torch.float32) * self.qscale[:, None]
        eye = torch.eye(self.in_features, dtype=torch.float32)
        return self(eye).t().contiguous()


def pack_int4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> QuantizedMatrix:
    """``q`` integers 0..15 ``[out, in]``, ``scale``/``offset`` fp32 ``[out, in / GROUP]``: the
    packed int4 matrix ``W = (q - 8) * scale + offset`` (per group of GROUP inputs)."""
    out_features, in_features = q.shape
    if in_features % GROUP:
        raise ValueError(f"int4 needs in_features divisible by {GROUP}, got {in_features}")
    groups = in_features // GROUP
    if scale.shape != (out_features, groups) or offset.shape != (out_features, groups):
        raise ValueError(
            f"scale and offset must be [{out_features}, {groups}], "
            f"got {tuple(scale.shape)}, {tuple(offset.shape)}"
        )
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("int4 values must lie in 0..15")
    pad = -out_features % ROW_MULTIPLE
    q32 = torch.nn.functional.pad(q.to(torch.int32), (0, 0, 0, pad))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32, 1)
    sz = torch.stack((scale, offset), dim=-1).to(torch.float32)  # [out, groups, 2]
    sz = torch.nn.functional.pad(sz, (0, 0, 0, 0, 0, pad)).transpose(0, 1).contiguous()
    return QuantizedMatrix(packed, sz, out_features)


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
