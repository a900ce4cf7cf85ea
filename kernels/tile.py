"""The inner step shared by the decode and prefill kernels: one tile of paged K/V, online softmax.

Why one helper: both kernels walk a sequence's tokens in tiles of ``BLOCK_N``, find each token's
physical block through the block table (one gather per token, so a tile may span several pages and
``BLOCK_N`` is independent of the cache's block size), and fold the tile into a running
(max, sum, accumulator) triple, flash-attention style. Scores use base-2 exponentials with
``log2(e)`` folded into the scale.

``UPCAST`` selects float32 math (the interpreter, which cannot do half-precision dots reliably,
and float32 caches on the GPU); otherwise the dots run on the tensor cores in the cache's dtype with
float32 accumulation. ``PRECISION`` is the float32 dots' ``input_precision``: "ieee" in the
interpreter (exact), "tf32x3" on the GPU: three TF32 tensor-core products give about float32
accuracy, whereas a plain fp32 ``tl.dot`` would silently be one TF32 product and "ieee" dots run
on the CUDA cores, spill kilobytes per thread at head_dim 256 and take a minute to compile.
"""

from __future__ import annotations

import triton
import triton.language as tl


def dot_precision(interpreted: bool) -> str:
    """``input_precision`` of the float32 dots (see the module docstring)."""
    return "ieee" if interpreted else "tf32x3"


# A Triton kernel, left unannotated: triton ships no types, and its compiler reads parameter
# annotations (tl.constexpr), so Python types there would mean something else.
@triton.jit  # type: ignore[untyped-decorator]
def _load_tile(ptrs, tmask, dmask, MASK_TAIL: tl.constexpr, FULL_D: tl.constexpr):  # type: ignore[no-untyped-def]
    """Load a [BLOCK_N, BLOCK_D] K or V tile, masking only what can be out of range."""
    if MASK_TAIL:
        x = tl.load(ptrs, mask=tmask[:, None] & dmask[None, :], other=0.0)
    elif FULL_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=dmask[None, :], other=0.0)
    return x


# A Triton kernel, left unannotated: triton ships no types, and its compiler reads parameter
# annotations (tl.constexpr), so Python types there would mean something else.
@triton.jit  # type: ignore[untyped-decorator]
def attend_tile(  # type: ignore[no-untyped-def]
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    bt_row,
    start,
    limit,
    q_pos,
    s_kb,
    s_ko,
    s_vb,
    s_vo,
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASK_TAIL: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Fold tokens ``[start, start + BLOCK_N)`` (those < ``limit`` when MASK_TAIL) into the state.

    ``k_base``/``v_base`` already point at the right kv head; ``bt_row`` at the sequence's block
    table row. ``q`` is [M, BLOCK_D] (float32 when UPCAST). With CAUSAL, row r only sees tokens
    ``<= q_pos[r]``. A row that has seen no token yet (everything masked so far) keeps max -inf; its
    exponentials use 0 as the reference instead, so it contributes nothing rather than NaN.
    """
    tok = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    if MASK_TAIL:
        tmask = tok < limit
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
    else:
        tmask = tok >= 0  # unused: full tiles are loaded without a token mask
        blk = tl.load(bt_row + tok // BLOCK_SIZE).to(tl.int64)
    off = (tok % BLOCK_SIZE).to(tl.int64)
    k = _load_tile(
        k_base + blk[:, None] * s_kb + off[:, None] * s_ko + d[None, :],
        tmask,
        dmask,
        MASK_TAIL,
        HEAD_DIM == BLOCK_D,
    )
    if UPCAST:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    if MASK_TAIL:
        s = tl.where(tmask[None, :], s, float("-inf"))
    if CAUSAL:
        s = tl.where(tok[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # fully masked row: exp2(-inf - 0) = 0, not NaN
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_tile(
        v_base + blk[:, None] * s_vb + off[:, None] * s_vo + d[None, :],
        tmask,
        dmask,
        MASK_TAIL,
        HEAD_DIM == BLOCK_D,
    )
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i
