"""The quantized linear layer's native kernels (``csrc/quant_linear.c``): int4 groups, int8 rows and
GGUF K-quant super-blocks (Q4_K, Q6_K) as the file holds them.

Why: a decode step's linear layers are bound by reading the weights, and PyTorch's weight-packed
int4 / int8 matmuls read them far below the memory's rate at a decode step's few rows (slower per
byte than the native fp32 kernel; docs/kernels.md, "Quantized linear layers", has the figures), so a
model held as integers decoded slower than in fp32 at a fifth of the bytes. These kernels read the
integers where they lie (the layouts are ``kernels/quant_linear.py``'s) at the memory's rate: each
weight widened once and multiplied into the accumulators of a tile of rows, an int4 group's scale
applied once per group. They serve every row count: ``bench/decode_floor.py`` found them ahead of
PyTorch's operators at every row count it runs (docs/kernels.md).

Called through ctypes, like ``kernels/cpu/linear.py`` (which says why). ``x`` is checked before any
pointer is used; the matrix's own tensors are checked here too (they may come from a shared region
another process filled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagedkv.arith import ceil_div
from pagedkv.kernels.cpu import native as cpu_native


class QuantizedMatrix(Protocol):
    """What the kernels read of ``pagedkv.kernels.quant_linear.QuantizedMatrix`` (which imports this
    module)."""

    @property
    def qweight(self) -> torch.Tensor: ...
    @property
    def qscale(self) -> torch.Tensor: ...
    @property
    def out_features(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def in_features(self) -> int: ...


# Which arithmetic a call's rows get (csrc/quant_linear.c's QUANT_ARITH_*, which says why): by the row
# count, each path where it is fastest (a row's bits then depend on how many rows share its call);
# every row as it would be alone (a decode step's and a speculative verification's rows); every row as
# in a many-row call (a prefill's rows). The last two give a row the same bits at any row count.
# Where int4 has the AMX tiles (``tile_products``), its rows take the first of those under all three.
ARITH_AUTO, ARITH_ROWS, ARITH_PANELS = 0, 1, 2
ARITHS = (ARITH_AUTO, ARITH_ROWS, ARITH_PANELS)

GROUP, PANEL, CHUNK = 32, 16, 256  # kernels/quant_linear.py's int4 layout (csrc/quant_linear.c's too)
KQ_BLOCK, KQ_BLOCK_BYTES = 256, {12: 144, 14: 210}  # kquant: GGML type id -> bytes per super-block


@dataclass(slots=True, frozen=True)
class InputRounding:
    """How a native integer kernel rounds x before its integer products (csrc/quant_linear.c says
    why): each ``block`` inputs of a row to q * d, with d = max|x| / ``top`` and q = x * (top /
    max|x|) rounded to nearest-even in fp32. The product it computes is W times x so rounded."""

    block: int
    top: int


# int4 and int8: 16-bit x per group of 32 (an error of at most 1/65534 of the group's largest |x|
# per input; int8's last group of a row whose width is not a multiple of 32 is the inputs left);
# K-quant blocks: 8-bit x per super-block, as llama.cpp's own K-quant products.
INPUT_ROUNDING = {
    "int4": InputRounding(GROUP, 32767),
    "int8": InputRounding(GROUP, 32767),
    "kquant": InputRounding(KQ_BLOCK, 127),
}


def simd() -> bool:
    """Whether the loaded variant runs the AVX2 + FMA code (else the plain C loops)."""
    lib = cpu_native.library()
    return lib is not None and bool(lib.pagedkv_quant_linear_simd())


def word_products(enable: bool | None = None) -> bool:
    """Whether int4 products of 1-7 rows of x and int8 products of one row (of a width that is a
    multiple of 32), and of any number of rows under ``ARITH_ROWS``, run as 16-bit integer
    multiply-adds (AVX-512 VNNI and VBMI, asked of the CPU at run time; csrc/quant_linear.c) rather
    than fp32 ones on the same rounded x. On by default where
    the CPU has them; ``enable`` turns them on or off for this process (tests and benchmarks compare
    the two), None only asks. False without the native library."""
    lib = cpu_native.library()
    if lib is None:
        return False
    return bool(lib.pagedkv_quant_words(-1 if enable is None else int(enable)))


def tile_products(enable: bool | None = None) -> bool:
    """Whether int4 products of 4 or more rows get their integer sums from the AMX tiles (AMX-INT8,
    asked of the CPU and the OS at run time; csrc/quant_linear.c): the word products' integers, so
    their bits, at a fraction of the vector instructions per row. While on, every int4 row takes the
    word products' arithmetic under every ``ARITH_*`` (a prefill's rows too: the tiles beat the
    dequantized panels at every row count). On by default where the CPU and the OS have them;
    ``enable`` turns them on or off for this process, None only asks. False without the native
    library."""
    lib = cpu_native.library()
    if lib is None:
        return False
    return bool(lib.pagedkv_quant_amx(-1 if enable is None else int(enable)))


def check_matrix(m: QuantizedMatrix) -> None:
    """Raise ValueError unless ``m``'s tensors are CPU, dense and shaped as its form says."""
    w, s, n = m.qweight, m.qscale, m.out_features
    if m.kind == "kquant":
        _check_kquant(w, s, n)
        return
    ok_cpu = w.is_cpu and s.is_cpu and w.is_contiguous() and s.is_contiguous() and s.dtype is torch.float32
    if m.kind == "int4":
        panels = ceil_div(n, PANEL)
        ok = (
            ok_cpu
            and w.dim() == 3
            and w.shape[0] == panels
            and w.shape[2] == CHUNK
            and tuple(s.shape) == (panels, w.shape[1], 2 * PANEL)
        )
        want = f"uint8 [{panels}, groups, {CHUNK}] and fp32 [{panels}, groups, {2 * PANEL}]"
    else:
        ok = ok_cpu and w.dtype is torch.int8 and w.dim() == 2 and w.shape[0] == n and tuple(s.shape) == (n,)
        want = f"int8 [{n}, in] and fp32 [{n}]"
    if not ok:
        raise ValueError(
            f"a {m.kind} matrix of {n} rows needs dense CPU tensors {want}, got {w.dtype} {tuple(w.shape)} "
            f"and {s.dtype} {tuple(s.shape)}"
        )


def _check_kquant(w: torch.Tensor, s: torch.Tensor, n: int) -> None:
    """A kquant matrix: uint8 bytes, int32 ``[segments, 2]`` (known type, positive rows) whose rows
    sum to ``n`` and whose bytes are a whole number of super-block columns."""
    ok = (
        w.is_cpu
        and s.is_cpu
        and w.is_contiguous()
        and s.is_contiguous()
        and w.dtype is torch.uint8
        and w.dim() == 1
        and s.dtype is torch.int32
        and s.dim() == 2
        and s.shape[0] > 0
        and s.shape[1] == 2
    )
    segs = s.tolist() if ok else []
    per_block = sum(r * KQ_BLOCK_BYTES.get(t, 0) for t, r in segs)
    ok = (
        ok
        and all(t in KQ_BLOCK_BYTES and r > 0 for t, r in segs)
        and sum(r for _, r in segs) == n
        and w.numel() > 0
        and w.numel() % per_block == 0
    )
    if not ok:
        raise ValueError(
            f"a kquant matrix of {n} rows needs dense CPU tensors uint8 [bytes] and int32 [segments, 2] "
            f"of (type {sorted(KQ_BLOCK_BYTES)}, rows > 0) summing to {n} rows, bytes a whole number of "
            f"super-blocks per row; got {w.dtype} {tuple(w.shape)} and "
            f"{s.dtype} {segs if segs else tuple(s.shape)}"
        )


@dataclass(slots=True, frozen=True)
class NativeMatmul:
    """One matrix's kernel with its arguments resolved once (the matrix checked at ``prepare``),
    so a call pays only for checking ``x``: a decode step makes about 120 of them."""

    matrix: QuantizedMatrix
    fn: Any  # the ctypes function
    weights: tuple[int, ...]  # the pointer (and stride) arguments after x's
    k: int  # the matrix's in_features and out_features, read once (properties of its tensors' shapes)
    n: int

    def one_arithmetic(self) -> bool:
        """Whether every ``ARITH_*`` gives this matrix's rows the same bits (int4 on the AMX tiles,
        ``tile_products``): a step's prefill and decode rows can then share one call."""
        return self.matrix.kind == "int4" and tile_products()

    def __call__(
        self, x: torch.Tensor, out: torch.Tensor | None = None, arith: int = ARITH_AUTO
    ) -> torch.Tensor:
        """``x`` fp32 ``[rows, in]`` (dense columns) times the matrix transposed -> ``[rows, out]``,
        into ``out`` when given (dense columns, rows not overlapping, not sharing ``x``'s memory),
        each row by the arithmetic ``arith`` names (``ARITH_*``)."""
        k, n = self.k, self.n
        if arith not in ARITHS:
            raise ValueError(f"arith must be one of {ARITHS}, got {arith!r}")
        if not (isinstance(x, torch.Tensor) and x.is_cpu and x.dtype is torch.float32 and x.dim() == 2):
            raise ValueError(f"x must be a 2-D fp32 CPU tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        rows = x.shape[0]
        if x.shape[1] != k or (rows and x.stride(1) != 1 and k > 1):
            raise ValueError(
                f"x must be [rows, {k}] with dense columns, got {tuple(x.shape)} strides {x.stride()}"
            )
        if out is None:
            y = torch.empty((rows, n), dtype=torch.float32)
        else:
            if not (
                isinstance(out, torch.Tensor)
                and out.is_cpu
                and out.dtype is torch.float32
                and out.shape == (rows, n)
                and (n <= 1 or out.stride(1) == 1)
            ):
                raise ValueError(
                    f"out must be fp32 [{rows}, {n}] with dense columns, got {out.dtype} {tuple(out.shape)}"
                )
            if rows > 1 and out.stride(0) < n:
                raise ValueError(f"out's rows overlap (row stride {out.stride(0)})")
            if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
                raise ValueError("out must not share memory with x")
            y = out
        if rows == 0 or n == 0:
            return y
        status = self.fn(
            rows,
            n,
            k,
            x.data_ptr(),
            x.stride(0),
            *self.weights,
            y.data_ptr(),
            y.stride(0),
            torch.get_num_threads(),
            arith,
        )
        if status != 0:
            raise MemoryError(f"the {self.matrix.kind} kernel could not allocate its scratch ({rows} x {k})")
        return y


def prepare(m: QuantizedMatrix) -> NativeMatmul:
    """``m``'s native kernel. Raises RuntimeError when the native library is not loaded and
    ValueError when ``m``'s tensors are not what its form says."""
    lib = cpu_native.library()
    if lib is None:
        raise RuntimeError("the native kernels are not loaded (kernels/cpu/native.py says why in the log)")
    check_matrix(m)
    k, n = m.in_features, m.out_features
    if m.kind == "int4":
        return NativeMatmul(m, lib.pagedkv_q4_linear, (m.qweight.data_ptr(), m.qscale.data_ptr()), k, n)
    if m.kind == "kquant":
        weights = (m.qweight.data_ptr(), m.qscale.data_ptr(), m.qscale.shape[0])
        return NativeMatmul(m, lib.pagedkv_kq_linear, weights, k, n)
    weights = (m.qweight.data_ptr(), m.qweight.stride(0), m.qscale.data_ptr())
    return NativeMatmul(m, lib.pagedkv_q8_linear, weights, k, n)


def matmul(
    m: QuantizedMatrix, x: torch.Tensor, out: torch.Tensor | None = None, arith: int = ARITH_AUTO
) -> torch.Tensor:
    """``prepare(m)(x, out, arith)``: one call (tests, benchmarks); a model prepares once."""
    return prepare(m)(x, out, arith)


def kquant_rows(m: QuantizedMatrix, ids: torch.Tensor) -> torch.Tensor:
    """fp32 rows ``W[ids]`` of a kquant matrix, each weight as the gguf package dequantizes it (an
    embedding lookup). Raises ValueError for an id outside the matrix (before any pointer is used)."""
    lib = cpu_native.library()
    if lib is None:
        raise RuntimeError("the native kernels are not loaded (kernels/cpu/native.py says why in the log)")
    check_matrix(m)
    ids = ids.to(device="cpu", dtype=torch.int64).contiguous().flatten()
    n = m.out_features
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise ValueError(f"row ids must lie in 0..{n - 1}")
    k = m.in_features
    out = torch.empty((ids.numel(), k), dtype=torch.float32)
    if ids.numel():
        lib.pagedkv_kq_rows(
            ids.numel(),
            ids.data_ptr(),
            k,
            m.qweight.data_ptr(),
            m.qscale.data_ptr(),
            m.qscale.shape[0],
            out.data_ptr(),
            k,
        )
    return out
