"""Triton kernels that move KV data: write new tokens into the cache, copy blocks (copy-on-write).

Why Triton rather than torch indexing: ``write_kv_cache`` runs every step for every layer; one
launch that reads the slot and writes K and V straight into their blocks avoids torch's
index-assignment machinery (several kernels and a mask compaction, which also syncs on the host for
-1 padding). ``copy_blocks`` copies all pairs in all layers in ONE launch: the layers' cache tensors
are separate allocations (or views), so the kernel reads their addresses from a small int64 table
and casts them to pointers.

All address arithmetic is int64 (block ids are cast before multiplying by strides), so caches with
more than 2^31 elements work. Caches may be strided views (e.g. one layer of a
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor); only head_dim must be
contiguous.

8-bit caches (``kernels/quant.py``) are quantized on write by ``_write_kv_quant_kernel``, to the same
bytes as the torch reference: the scale is ``amax / qmax`` and values ``x / scale`` with correctly
rounded divisions (``div_rn``: a plain fp32 ``/`` is approximate on the GPU), int8 rounded to nearest
with ties to even (``torch.round``), e4m3 rounded to nearest even in fp32 arithmetic first and then
cast, exactly (Triton's interpreter rounds some values to the wrong binade when it casts itself).
``copy_blocks`` moves whole rows as bytes, so the scales travel with their blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from pagedkv.kernels import quant


# A Triton kernel, left unannotated: triton ships no types, and its compiler reads parameter
# annotations (tl.constexpr), so Python types there would mean something else.
@triton.jit  # type: ignore[untyped-decorator]
def _write_kv_kernel(  # type: ignore[no-untyped-def]
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    num_kv_heads,
    head_dim,
    block_size,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_kcb,
    s_kco,
    s_kch,
    s_vcb,
    s_vco,
    s_vch,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token: leave the cache untouched
        return
    blk = slot // block_size
    off = slot % block_size
    d = tl.arange(0, BLOCK_D)
    mask = (h < num_kv_heads)[:, None] & (d < head_dim)[None, :]
    hh = h.to(tl.int64)[:, None]
    k = tl.load(key_ptr + tok * s_kt + hh * s_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * s_vt + hh * s_vh + d[None, :], mask=mask)
    tl.store(
        key_cache_ptr + blk * s_kcb + off * s_kco + hh * s_kch + d[None, :],
        k.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        value_cache_ptr + blk * s_vcb + off * s_vco + hh * s_vch + d[None, :],
        v.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


# A Triton kernel, left unannotated: triton ships no types, and its compiler reads parameter
# annotations (tl.constexpr), so Python types there would mean something else.
@triton.jit
def _round_half_even(y):  # type: ignore[no-untyped-def]
    """fp32 ``y`` rounded to the nearest integer, ties to even (``torch.round``); exact for |y| < 2**22."""
    f = tl.floor(y + 0.5)
    tie = (f - y) == 0.5
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where(tie & odd, f - 1.0, f)


# A Triton kernel, left unannotated: triton ships no types, and its compiler reads parameter
# annotations (tl.constexpr), so Python types there would mean something else.
@triton.jit  # type: ignore[untyped-decorator]
def _quantize_rows(x, QMAX: tl.constexpr, FP8: tl.constexpr):  # type: ignore[no-untyped-def]
    """Rows ``x`` [H, D] (fp32, padding 0) as (8-bit-representable fp32 values, fp32 scales [H])."""
    scale = tl.math.div_rn(tl.max(tl.abs(x), 1), QMAX)
    safe = tl.where(scale > 0, scale, 1.0)
    y = tl.math.div_rn(x, safe[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if FP8:
        # e4m3: 3 mantissa bits; the quantum is 2^(exponent - 3), 2^-9 below the normals (2^-6).
        e = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
        inv_step = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e): exact products
        q = _round_half_even(y * inv_step) * step
        q = tl.where(q == 0.0, y * 0.0, q)  # keep the sign of zero, as torch's cast does
    else:
        q = _round_half_even(y)
    return q, scale


# A Triton kernel, left unannotated: triton ships no types, and its compiler reads parameter
# annotations (tl.constexpr), so Python types there would mean something else.
@triton.jit  # type: ignore[untyped-decorator]
def _write_kv_quant_kernel(  # type: ignore[no-untyped-def]
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
    slot_ptr,
    num_kv_heads,
    head_dim,
    block_size,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_kcb,
    s_kco,
    s_kch,
    s_vcb,
    s_vco,
    s_vch,
    s_ksb,
    s_kso,
    s_ksh,
    s_vsb,
    s_vso,
    s_vsh,
    QMAX: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token: leave the cache untouched
        return
    blk = slot // block_size
    off = slot % block_size
    d = tl.arange(0, BLOCK_D)
    hmask = h < num_kv_heads
    mask = hmask[:, None] & (d < head_dim)[None, :]
    hh = h.to(tl.int64)
    k = tl.load(key_ptr + tok * s_kt + hh[:, None] * s_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + tok * s_vt + hh[:, None] * s_vh + d[None, :], mask=mask, other=0.0)
    kq, ks = _quantize_rows(k.to(tl.float32), QMAX, FP8)
    vq, vs = _quantize_rows(v.to(tl.float32), QMAX, FP8)
    tl.store(
        key_cache_ptr + blk * s_kcb + off * s_kco + hh[:, None] * s_kch + d[None, :],
        kq.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        value_cache_ptr + blk * s_vcb + off * s_vco + hh[:, None] * s_vch + d[None, :],
        vq.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(key_scale_ptr + blk * s_ksb + off * s_kso + hh * s_ksh, ks, mask=hmask)
    tl.store(value_scale_ptr + blk * s_vsb + off * s_vso + hh * s_vsh, vs, mask=hmask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if quant.is_quantized(key_cache):
        _write_kv_quantized(key, value, key_cache, value_cache, slot_mapping)
        return
    block_d = triton.next_power_of_2(head_dim)
    # ~2-4K elements per program: enough work per program, few programs in the interpreter.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_kv_heads,
        head_dim,
        key_cache.shape[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )


def _write_kv_quantized(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
    ks, vs = quant.scales(key_cache), quant.scales(value_cache)
    _write_kv_quant_kernel[(num_tokens, triton.cdiv(num_kv_heads, block_h))](
        key,
        value,
        key_cache,
        value_cache,
        ks,
        vs,
        slot_mapping,
        num_kv_heads,
        head_dim,
        key_cache.shape[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        *ks.stride(),
        *vs.stride(),
        QMAX=quant.QMAX[key_cache.dtype],
        FP8=key_cache.dtype is not torch.int8,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )


# Elements one copy_blocks program moves per loop iteration: 4096 made ptxas spill on sm_90.
COPY_CHUNK = 2048


# A Triton kernel, left unannotated: triton ships no types, and its compiler reads parameter
# annotations (tl.constexpr), so Python types there would mean something else.
@triton.jit(do_not_specialize=["num_kv_heads", "head_dim", "block_numel"])  # type: ignore[untyped-decorator]
def _copy_blocks_kernel(  # type: ignore[no-untyped-def]
    cache_ptrs,
    pairs_ptr,
    dtype_ref_ptr,
    s_b,
    s_o,
    s_h,
    num_kv_heads,
    head_dim,
    block_numel,
    CONTIGUOUS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    # Each layer's K or V cache is its own tensor: fetch its address and make it a typed pointer.
    base = tl.load(cache_ptrs + which).to(tl.pointer_type(dtype_ref_ptr.dtype.element_ty))
    src = tl.load(pairs_ptr + pair * 2).to(tl.int64)
    dst = tl.load(pairs_ptr + pair * 2 + 1).to(tl.int64)
    src_base = base + src * s_b
    dst_base = base + dst * s_b
    for start in range(0, block_numel, CHUNK):
        e = start + tl.arange(0, CHUNK)
        mask = e < block_numel
        if CONTIGUOUS:
            offs = e.to(tl.int64)
        else:
            d = e % head_dim
            h = (e // head_dim) % num_kv_heads
            o = e // (head_dim * num_kv_heads)
            offs = o.to(tl.int64) * s_o + h.to(tl.int64) * s_h + d
        x = tl.load(src_base + offs, mask=mask)
        tl.store(dst_base + offs, x, mask=mask)


def copy_blocks(
    key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], pairs: torch.Tensor
) -> None:
    caches = list(key_caches) + list(value_caches)
    n = pairs.shape[0]
    if n == 0 or not caches:
        return
    # 8-bit rows (values + scale bytes) are copied as bytes: whole rows, the scales with their blocks.
    ref = caches[0].view(torch.int8) if quant.is_quantized(caches[0]) else caches[0]
    dev = ref.device
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64).to(dev, non_blocking=True)
    pairs_dev = pairs.to(device=dev, dtype=torch.int64).contiguous()
    _, block_size, num_kv_heads, head_dim = ref.shape
    s_b, s_o, s_h, _ = ref.stride()
    contiguous = s_h == head_dim and s_o == num_kv_heads * head_dim
    block_numel = block_size * num_kv_heads * head_dim
    chunk = min(COPY_CHUNK, triton.next_power_of_2(block_numel))
    _copy_blocks_kernel[(n, len(caches))](
        ptrs,
        pairs_dev,
        ref,
        s_b,
        s_o,
        s_h,
        num_kv_heads,
        head_dim,
        block_numel,
        CONTIGUOUS=contiguous,
        CHUNK=chunk,
        num_warps=4,
    )


def _is_interpreted(fn: object) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


# Decided when the @triton.jit decorators ran (TRITON_INTERPRET at import time), not now.
INTERPRETED: bool = _is_interpreted(_write_kv_kernel)
