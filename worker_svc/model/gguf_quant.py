"""A GGUF file's quantized matrices as integers the CPU's weight-packed matmuls read
(``kernels/quant_linear.py``), instead of fp32 copies 4-8x the file's size.

Which form each GGUF type takes (``form_of``):

- Q4_K, Q6_K: ``kquant``, the file's super-blocks byte for byte (``KBlocks``; the native kernels
  read them as they are, ``kernels/quant_linear.py``), so nothing is converted and the matrix takes
  the file's bytes. This includes the token embedding (its rows are dequantized when looked up).
- Q4_0, Q4_1: ``int4``, exactly (``int4_parts`` reads Q4_K into this form too; a GGUF K-quant
  matrix's rows are always whole super-blocks, so ``form_of`` never picks it for Q4_K). Each is
  4-bit values with one scale and one offset per 32 weights (Q4_0: ``d * (q - 8)``; Q4_1:
  ``d * q + m``; Q4_K: ``d * sc * q - dmin * m`` per 32-weight sub-block), i.e. ``(q - 8) * s + z``
  with ``s``, ``z`` per group of 32: the same integers, the scale and offset computed once in fp32
  (equal to the gguf package's dequantization up to fp32 rounding of ``z``;
  tests/worker_svc/model/test_gguf_quant.py).
- Q8_0, Q5_0, Q5_1, Q5_K: ``int8`` with one scale per row, requantized from the gguf
  package's dequantization once at load. PyTorch's int8 operator has no per-group scales, so this is
  a conversion with an error, measured per matrix (``ConversionError``) and written down in
  docs/kernels.md.
- A fused matrix (QKV, gate/up) of K-quant parts is one ``kquant`` matrix of row segments, even
  when its parts' types differ (a Q4_K_M file's Q4_K query beside its Q6_K value rows); parts of
  different forms otherwise become ``int8`` rows.
- The token embedding is otherwise ``int8`` (rows are looked up, and the int4 layout is blocked).
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

from pagedkv.kernels import quant_linear
from pagedkv.kernels.quant_linear import QuantizedMatrix

KQUANT_TYPES = tuple(quant_linear.KQUANT_TYPES)  # Q4_K, Q6_K: held as the file's blocks
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # what int4_parts reads
INT8_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K")
DENSE_TYPES = ("F32", "F16", "BF16")
EMBEDDING = "model.embed_tokens.weight"

_ONE_F16 = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
_ZERO_F16 = np.zeros(2, dtype=np.uint8)


def form_of(type_name: str, hf_name: str, shape: tuple[int, ...]) -> str:
    """``kquant``, ``int4``, ``int8`` or ``dense``: how a tensor of this GGUF type is held (module
    docstring)."""
    if len(shape) != 2 or type_name in DENSE_TYPES:
        return "dense"
    if type_name in KQUANT_TYPES and shape[1] % quant_linear.KQ_BLOCK == 0:
        return "kquant"
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


@dataclass(slots=True)
class KBlocks:
    """A K-quant matrix as the file holds it: row segments ``(GGUF type, uint8 [rows, row_bytes])``
    of 256-weight super-blocks (one segment per file tensor; a fused matrix joins several)."""

    segments: list[tuple[str, torch.Tensor]]

    @classmethod
    def from_raw(cls, raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> KBlocks:
        """``raw`` uint8 ``[rows, row_bytes]`` (e.g. a memory-mapped tensor), copied once."""
        if type_name not in KQUANT_TYPES or shape[1] % quant_linear.KQ_BLOCK:
            raise ValueError(f"{type_name} {shape} is not held as kquant (types {', '.join(KQUANT_TYPES)})")
        return cls([(type_name, torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(shape[0], -1))])

    @property
    def kind(self) -> str:
        return "kquant"

    @property
    def shape(self) -> tuple[int, int]:
        name, raw = self.segments[0]
        size = quant_linear.KQ_BLOCK_BYTES[quant_linear.KQUANT_TYPES[name]]
        rows = sum(int(r.shape[0]) for _, r in self.segments)
        return (rows, int(raw.shape[1]) // size * quant_linear.KQ_BLOCK)

    def take_rows(self, index: torch.Tensor) -> KBlocks:
        """Rows ``index`` (a permutation of a single-segment matrix's rows, e.g. llama's Q/K order)."""
        if len(self.segments) != 1:
            raise ValueError("take_rows needs a single-segment kquant matrix")
        name, raw = self.segments[0]
        return KBlocks([(name, raw.index_select(0, index))])

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix, by the gguf package's own dequantization."""
        return self.pack().dequantize()

    def pack(self) -> QuantizedMatrix:
        return quant_linear.pack_kquant(self.segments)


Held = Unpacked | KBlocks


def to_int8(x: Held | torch.Tensor) -> Unpacked:
    """Requantize to int8 rows (for fusing parts of different forms)."""
    if isinstance(x, Unpacked) and x.kind == "int8":
        return x
    w = x.dequantize() if isinstance(x, (Unpacked, KBlocks)) else x
    m = quant_linear.quantize_int8_rows(w)
    return Unpacked(m.qweight, m.qscale, None)


def concat(parts: list[Held | torch.Tensor]) -> Held | torch.Tensor:
    """Row-concatenate the parts of a fused matrix: K-quant parts as row segments, int4 parts as
    int4; mixed forms are all requantized to int8 rows."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts).contiguous()  # type: ignore[arg-type]
    if all(isinstance(p, KBlocks) for p in parts):
        return KBlocks([seg for p in parts if isinstance(p, KBlocks) for seg in p.segments])
    kinds = {p.kind if isinstance(p, (Unpacked, KBlocks)) else "dense" for p in parts}
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


def conversion_error(name: str, held: Held, reference: torch.Tensor) -> ConversionError:
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
