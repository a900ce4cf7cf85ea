"""A GGUF file's quantized matrices as integers the CPU's weight-packed matmuls read
(``kernels/quant_linear.py``), instead of fp32 copies 4-8x the file's size.

Which form each GGUF type takes (``form_of``):

- Q4_0, Q4_1, Q4_K: ``int4``, exactly. Each is 4-bit values with one scale and one offset per 32
  weights (Q4_0: ``d * (q - 8)``; Q4_1: ``d * q + m``; Q4_K: ``d * sc * q - dmin * m`` per 32-weight
  sub-block), i.e. ``(q - 8) * s + z`` with ``s``, ``z`` per group of 32: the same integers, the
  scale and offset computed once in fp32 (equal to the gguf package's dequantization up to fp32
  rounding of ``z``; tests/worker_svc/test_gguf_quant.py).
- Q8_0, Q5_0, Q5_1, Q5_K, Q6_K: ``int8`` with one scale per row, requantized from the gguf
  package's dequantization once at load. PyTorch's int8 operator has no per-group scales, so this is
  a conversion with an error, measured per matrix (``ConversionError``) and written down in
  docs/kernels.md.
- The token embedding is always ``int8`` (rows are looked up, and the int4 layout is blocked).
- F32, F16, BF16 and every vector (norms, biases) stay dense (fp32).

How the integers are read without parsing the block formats here: the gguf package's own
``dequantize`` runs on copies of the raw blocks with their scales patched (d = 1, m = 0 gives the
integers; unit integers give Q4_K's 6-bit sub-block scales; d = 0, dmin = 1 its minimums), so
the bit layout stays the package's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels import quant_linear
from kernels.quant_linear import QuantizedMatrix

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")
DENSE_TYPES = ("F32", "F16", "BF16")
EMBEDDING = "model.embed_tokens.weight"

_ONE_F16 = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
_ZERO_F16 = np.zeros(2, dtype=np.uint8)


def form_of(type_name: str, hf_name: str, shape: tuple[int, ...]) -> str:
    """``int4``, ``int8`` or ``dense``: how a tensor of this GGUF type is held (module docstring)."""
    if len(shape) != 2 or type_name in DENSE_TYPES:
        return "dense"
    if hf_name == EMBEDDING:
        return "int8"
    if type_name in INT4_TYPES and shape[1] % quant_linear.GROUP == 0:
        return "int4"
    return "int8"


@dataclass(slots=True)
class Unpacked:
    """A quantized matrix before packing: fusion and row permutations act on these rows.

    int4: ``q`` uint8 0..15, ``scale``/``offset`` fp32 ``[out, in / 32]``; int8: ``q`` int8,
    ``scale`` fp32 ``[out]``, ``offset`` None."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None

    @property
    def kind(self) -> str:
        return "int4" if self.offset is not None else "int8"

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def take_rows(self, index: torch.Tensor) -> Unpacked:
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return Unpacked(self.q.index_select(0, index), self.scale.index_select(0, index), pick(self.offset))

    def dequantize(self) -> torch.Tensor:
        if self.offset is None:
            return self.q.to(torch.float32) * self.scale[:, None]
        g = quant_linear.GROUP
        s = self.scale.repeat_interleave(g, dim=1)
        z = self.offset.repeat_interleave(g, dim=1)
        return (self.q.to(torch.float32) - 8) * s + z

    def pack(self) -> QuantizedMatrix:
        if self.offset is None:
            return quant_linear.pack_int8(self.q, self.scale)
        return quant_linear.pack_int4(self.q, self.scale, self.offset)


def to_int8(x: Unpacked | torch.Tensor) -> Unpacked:
    """Requantize to int8 rows (for fusing parts of different forms)."""
    if isinstance(x, Unpacked) and x.kind == "int8":
        return x
    w = x.dequantize() if isinstance(x, Unpacked) else x
    m = quant_linear.quantize_int8_rows(w)
    return Unpacked(m.qweight, m.qscale, None)


def concat(parts: list[Unpacked | torch.Tensor]) -> Unpacked | torch.Tensor:
    """Row-concatenate the parts of a fused matrix; mixed forms are all requantized to int8 rows."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts).contiguous()  # type: ignore[arg-type]
    kinds = {p.kind if isinstance(p, Unpacked) else "dense" for p in parts}
    us = [p for p in parts if isinstance(p, Unpacked)] if kinds == {"int4"} else [to_int8(p) for p in parts]
    offsets = [u.offset for u in us]
    return Unpacked(
        torch.cat([u.q for u in us]),
        torch.cat([u.scale for u in us]),
        None if offsets[0] is None else torch.cat([o for o in offsets if o is not None]),
    )


def fused_form(forms: list[str]) -> str:
    """The form a fused matrix takes given its parts' forms (``concat``'s rule)."""
    kinds = set(forms)
    return kinds.pop() if len(kinds) == 1 else "int8"


def _patched(blocks: np.ndarray, at: int, value: np.ndarray) -> np.ndarray:
    out = blocks.copy()
    out[..., at : at + value.size] = value
    return out


def int4_parts(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Unpacked:
    """``raw`` uint8 ``[rows, row_bytes]`` blocks of Q4_0 / Q4_1 / Q4_K -> the int4 integers, scales
    and offsets (``(q - 8) * scale + offset`` per 32 weights)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // block, size)
    g = quant_linear.GROUP

    def deq(b: np.ndarray) -> np.ndarray:
        return np.asarray(dequantize(b.reshape(rows, -1), qtype), dtype=np.float32).reshape(rows, cols)

    def group_first(a: np.ndarray) -> torch.Tensor:  # one value per 32-weight group
        return torch.from_numpy(np.ascontiguousarray(a.reshape(rows, cols // g, g)[:, :, 0]))

    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]  # [rows, blocks]
    if type_name == "Q4_0":
        q = deq(_patched(blocks, 0, _ONE_F16)) + 8.0
        scale = torch.from_numpy(d)
        offset = torch.zeros_like(scale)
    elif type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
        unit = _patched(_patched(blocks, 0, _ONE_F16), 2, _ZERO_F16)
        q = deq(unit)
        scale = torch.from_numpy(d)
        offset = torch.from_numpy(m) + 8.0 * scale
    elif type_name == "Q4_K":
        dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
        unit = _patched(_patched(blocks, 0, _ONE_F16), 2, _ZERO_F16)
        scaled_q = deq(unit)  # sc * q
        ones = unit.copy()
        ones[..., 16:] = 0x11
        sc = deq(ones)  # sc per weight
        mins = -deq(_patched(_patched(blocks, 0, _ZERO_F16), 2, _ONE_F16))  # m per weight
        q = np.divide(scaled_q, sc, out=np.zeros_like(sc), where=sc > 0)
        sub = torch.from_numpy(np.repeat(d, block // g, axis=1))  # d per 32-weight group
        sub_min = torch.from_numpy(np.repeat(dmin, block // g, axis=1))
        scale = sub * group_first(sc)
        offset = 8.0 * scale - sub_min * group_first(mins)
    else:
        raise ValueError(f"{type_name} is not an int4 GGUF type; int4 types: {', '.join(INT4_TYPES)}")
    qt = torch.from_numpy(np.rint(q)).to(torch.uint8)
    return Unpacked(qt, scale.contiguous(), offset.contiguous())


@dataclass(slots=True, frozen=True)
class ConversionError:
    """How far a held matrix is from the file's own (gguf-dequantized) weights."""

    name: str
    form: str
    max_abs: float
    rel_rms: float  # ||held - file|| / ||file||


def conversion_error(name: str, held: Unpacked, reference: torch.Tensor) -> ConversionError:
    diff = held.dequantize() - reference
    norm = float(reference.norm())
    return ConversionError(
        name,
        held.kind,
        float(diff.abs().max()) if diff.numel() else 0.0,
        float(diff.norm()) / norm if norm > 0 else 0.0,
    )


def quantize_int4_groups(w: torch.Tensor) -> Unpacked:
    """Round an fp32 matrix to int4 with a scale and offset per 32 inputs (each group's minimum to
    maximum in 15 steps): the load-time int4 form of a dense checkpoint."""
    g = quant_linear.GROUP
    rows, cols = w.shape
    grouped = w.to(torch.float32).reshape(rows, cols // g, g)
    lo, hi = grouped.amin(dim=2), grouped.amax(dim=2)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((grouped - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return Unpacked(q.reshape(rows, cols), scale.contiguous(), (lo + 8.0 * scale).contiguous())
