"""The inner step shared by the decode and prefill kernels: one tile of paged K/V, online softmax.

Why one helper: both kernels walk a sequence's tokens in tiles of ``BLOCK_N``, find each token's
physical block through the block table (one gather per token, so a tile may span several pages and
``BLOCK_N`` is independent of the cache's block size), and fold the tile into a running
(max, sum, accumulator) triple, flash-attention style. Scores use base-2 exponentials with
``log2(e)`` folded into the scale.

``UPCAST`` selects float32 math (the interpreter, which cannot do half-precision dots reliably,
and float32 caches on the GPU); otherwise the dots run on the tensor cores in the cache's dtype with
float32 accumulation. ``QUANT`` selects an 8-bit cache (``kernels/quant.py``): K/V rows hold int8 or
fp8 e4m3 values and each (token, KV head) row has its fp32 scale, read through a second pointer (an
fp32 view of the same rows' last four bytes). Values widen exactly to the dot's dtype (|int8| <= 127
and e4m3's 3 mantissa bits fit fp16 and bf16); a key's scale multiplies its column of scores after
the dot (the dot accumulates in float32), and a value's scale joins its column of probabilities
before the second dot, divided by the tile's largest value scale, which multiplies the dot's result:
P stays within [0, 1] (a 16-bit P of tiny-valued rows does not sink into subnormals), and no
[BLOCK_N, head_dim] float32 tile of dequantized values is formed (that one made sm_90 spill).
``PRECISION`` is the float32 dots' ``input_precision``: "ieee" in the
interpreter (exact), "tf32x3" on the GPU: three TF32 tensor-core products give about float32
accuracy, whereas a plain fp32 ``tl.dot`` would silently be one TF32 product and "ieee" dots run
on the CUDA cores, spill kilobytes per thread at head_dim 256 and take a minute to compile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels import quant


def scale_args(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[list[object], bool]:
    """The kernels' scale arguments (K and V scale tensors, then their block / offset / head strides)
    and QUANT: the fp32 views of an 8-bit cache's row scales, or the caches themselves with zero
    strides (never read) when they hold model-dtype rows."""
    if not quant.is_quantized(key_cache):
        return [key_cache, value_cache, 0, 0, 0, 0, 0, 0], False
    ks, vs = quant.scales(key_cache), quant.scales(value_cache)
    return [ks, vs, *ks.stride(), *vs.stride()], True


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
def _load_scales(ptrs, tmask, MASK_TAIL: tl.constexpr):  # type: ignore[no-untyped-def]
    """A tile's [BLOCK_N] fp32 row scales; tokens past the tail read 0 (their slots may hold NaN)."""
    if MASK_TAIL:
        x = tl.load(ptrs, mask=tmask, other=0.0)
    else:
        x = tl.load(ptrs)
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
    lower,
    limit,
    q_pos,
    q_lo,
    s_kb,
    s_ko,
    s_vb,
    s_vo,
    ks_base,
    vs_base,
    s_ksb,
    s_kso,
    s_vsb,
    s_vso,
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASK_TAIL: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Fold tokens ``[start, start + BLOCK_N)`` (those in ``[lower, limit)`` when MASK_TAIL) into the
    state. Tokens outside are neither read nor their block-table entries used: below ``lower`` lie
    a sliding window's released blocks.

    ``k_base``/``v_base`` already point at the right kv head; ``bt_row`` at the sequence's block
    table row. With QUANT, ``ks_base``/``vs_base`` point at that head's fp32 scales (strides
    ``s_ksb``/``s_kso`` per block and offset, in floats); otherwise they are unused. ``q`` is
    [M, BLOCK_D] (float32 when UPCAST). With CAUSAL, row r only sees tokens ``<= q_pos[r]``; with
    WINDOWED (a sliding window), only tokens ``>= q_lo[r]``. A row
    that has seen no token yet (everything masked so far) keeps max -inf; its exponentials use 0 as
    the reference instead, so it contributes nothing rather than NaN.
    """
    tok = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    if MASK_TAIL:
        tmask = (tok < limit) & (tok >= lower)
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
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    if QUANT:
        k_scale = _load_scales(ks_base + blk * s_ksb + off * s_kso, tmask, MASK_TAIL)
        s = s * (k_scale * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if MASK_TAIL:
        s = tl.where(tmask[None, :], s, float("-inf"))
    if CAUSAL:
        s = tl.where(tok[None, :] <= q_pos[:, None], s, float("-inf"))
    if WINDOWED:
        s = tl.where(tok[None, :] >= q_lo[:, None], s, float("-inf"))
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
    if QUANT:
        # Each value row's scale joins its probability, relative to the tile's largest scale (so a
        # 16-bit P keeps its range whatever the values' magnitude), which multiplies the dot.
        v_scale = _load_scales(vs_base + blk * s_vsb + off * s_vso, tmask, MASK_TAIL)
        v_top = tl.max(v_scale, 0)
        v_top = tl.where(v_top > 0, v_top, 1.0)
        pv = p * (v_scale * (1.0 / v_top))[None, :]
    else:
        pv = p
    if UPCAST:
        pv_v = tl.dot(pv, v.to(tl.float32), input_precision=PRECISION)
    else:
        pv_v = tl.dot(pv.to(q.dtype), v.to(q.dtype))
    if QUANT:
        pv_v = pv_v * v_top
    acc = acc * alpha[:, None] + pv_v
    return acc, m_new, l_i
