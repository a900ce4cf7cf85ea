"""Paged prefill attention in Triton: flash-attention over the paged cache, causal, ragged batch.

Why this shape: a prefill (or a chunk of one) is compute-bound, so each program owns a tile of
``BLOCK_M`` query rows and streams that sequence's K/V tiles through the online-softmax step shared
with decode (``pagedkv.kernels.tile``). Queries are the LAST ``q_len`` of the sequence's ``seq_len`` cached
tokens, so query token i sits at absolute position ``seq_len - q_len + i``: a chunk after a
prefix-cache hit (or a chunked prefill) attends to everything cached before it.

GQA packing (as vLLM's unified attention does): a program serves one KV head, and its ``BLOCK_M``
rows are (query token, query head of that KV head's group) pairs, ``BLOCK_M // group`` tokens times
``group`` heads. Each K/V tile is therefore read once per KV head instead of once per query head,
which is what makes prefill with 4-8x GQA compete with contiguous SDPA.

The key range of a query tile splits in two: tokens before the tile's first query position are
visible to every row and are processed without any masks; the rest (the diagonal, plus the ragged
tail) use the causal and length masks. Grid: (query tile, kv head, sequence), with the tile index
reversed so the most expensive tiles (most keys) start first. ``group`` and the tile's token count
are not specialised on, so one binary serves every GQA ratio.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.tile import attend_tile, dot_precision, scale_args

LOG2E = 1.4426950408889634


# A Triton kernel, left unannotated: triton ships no types, and its compiler reads parameter
# annotations (tl.constexpr), so Python types there would mean something else.
@triton.jit(do_not_specialize=["group", "block_q", "window"])  # type: ignore[untyped-decorator]
def _prefill_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    qk_scale,
    group,
    block_q,
    window,
    s_qt,
    s_qh,
    s_ot,
    s_oh,
    s_kb,
    s_ko,
    s_kh,
    s_vb,
    s_vo,
    s_vh,
    s_bt,
    k_scale_ptr,
    v_scale_ptr,
    s_ksb,
    s_kso,
    s_ksh,
    s_vsb,
    s_vso,
    s_vsh,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    seq = tl.program_id(2).to(tl.int64)

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    if tile * block_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx = seq_len - q_len  # tokens cached before this sequence's first query

    # Row r of the tile is query token tile * block_q + r // group of query head kvh * group + r % group:
    # the kv head's whole group shares each K/V tile (rows past block_q * group are padding).
    r = tl.arange(0, BLOCK_M)
    m = tile * block_q + r // group
    heads = kvh * group + r % group
    d = tl.arange(0, BLOCK_D)
    mmask = (m < q_len) & (r < block_q * group)
    dmask = d < HEAD_DIM
    rows = (q_start + m).to(tl.int64)
    qo_mask = mmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + rows[:, None] * s_qt + heads[:, None] * s_qh + d[None, :], mask=qo_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx + m

    k_base = k_cache_ptr + kvh * s_kh
    v_base = v_cache_ptr + kvh * s_vh
    ks_base = k_scale_ptr + kvh * s_ksh  # unused unless QUANT
    vs_base = v_scale_ptr + kvh * s_vsh
    bt_row = block_tables_ptr + seq * s_bt

    first_pos = ctx + tile * block_q
    hi = tl.minimum(seq_len, first_pos + block_q)
    lo_diag = first_pos // BLOCK_N * BLOCK_N
    # A sliding window (window > 0): row r sees keys from q_lo[r] = q_pos[r] - window + 1 on. The
    # tile reads keys from kv_lo, its first row's first (never a token before: their blocks may have
    # been released); keys before last_lo, its last row's first, get the window mask; keys from
    # there to the diagonal are seen by every row. Without a window kv_lo = last_lo = 0: as before.
    q_lo = q_pos - window + 1
    kv_lo = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
    last_lo = tl.where(window > 0, tl.maximum(first_pos + block_q - window, 0), 0)
    edge_end = tl.minimum(tl.cdiv(last_lo, BLOCK_N) * BLOCK_N, lo_diag)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # The window's edge: tokens below kv_lo not read, the window mask per row.
    for t in range(kv_lo // BLOCK_N * BLOCK_N, edge_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc,
            m_i,
            l_i,
            q,
            k_base,
            v_base,
            bt_row,
            t,
            kv_lo,
            hi,
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
            BLOCK_SIZE,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            True,
            False,
            True,
            UPCAST,
            PRECISION,
            QUANT,
        )
    # Keys every row of the tile sees: no masks at all.
    for t in range(edge_end, lo_diag, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc,
            m_i,
            l_i,
            q,
            k_base,
            v_base,
            bt_row,
            t,
            0,
            hi,
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
            BLOCK_SIZE,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            False,
            False,
            False,
            UPCAST,
            PRECISION,
            QUANT,
        )
    # The diagonal and the tail: causal + length masks (and under a window, its mask: a window
    # shorter than the tile hides keys of the diagonal from later rows).
    if window > 0:
        for t in range(tl.maximum(lo_diag, edge_end), hi, BLOCK_N):
            acc, m_i, l_i = attend_tile(
                acc,
                m_i,
                l_i,
                q,
                k_base,
                v_base,
                bt_row,
                t,
                kv_lo,
                hi,
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
                BLOCK_SIZE,
                HEAD_DIM,
                BLOCK_N,
                BLOCK_D,
                True,
                True,
                True,
                UPCAST,
                PRECISION,
                QUANT,
            )
    else:
        for t in range(lo_diag, hi, BLOCK_N):
            acc, m_i, l_i = attend_tile(
                acc,
                m_i,
                l_i,
                q,
                k_base,
                v_base,
                bt_row,
                t,
                0,
                hi,
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
                BLOCK_SIZE,
                HEAD_DIM,
                BLOCK_N,
                BLOCK_D,
                True,
                True,
                False,
                UPCAST,
                PRECISION,
                QUANT,
            )
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * s_ot + heads[:, None] * s_oh + d[None, :],
        res.to(out_ptr.dtype.element_ty),
        mask=qo_mask,
    )


def block_d(head_dim: int) -> int:
    """Padded head_dim tile: a power of two, at least 16 (``tl.dot`` needs K >= 16 on a GPU)."""
    return max(16, int(triton.next_power_of_2(head_dim)))  # triton is untyped


def tile_config(
    head_dim: int, max_rows: int, interpreted: bool, upcast: bool = False, quantized: bool = False
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M counts (query token, head) rows, and
    ``max_rows`` is the longest query run times the GQA group.

    float32 (``upcast``: tf32x3 dots, three tensor-core products each) gets small 16x16 tiles and
    one stage: 64-128-row tiles spill kilobytes per thread on sm_90 and take much longer to
    compile (see ``python -m pagedkv.kernels.aot``; 16x16 does not spill up to head_dim 128).
    8-bit caches (``quantized``) widen each K/V tile in registers, and smaller tiles keep sm_90 from
    spilling with both triton 3.6 (the GPU image's) and 3.7: 64 x 64 up to head_dim 64 (over 8 warps
    past 64 rows: 128 x 64 spilled 120-192 B per thread), 32 x 32 above (64 x 64 spilled 24-88 B at
    head_dim 128 with triton 3.6, and 8 warps at 256).
    """
    if interpreted:
        return 32, 32, 4, 1
    if upcast:
        return (16, 16, 4, 1) if head_dim <= 128 else (16, 16, 8, 1)
    if quantized:
        if head_dim > 128:
            return 32, 32, 8, 2
        if head_dim > 64:
            return 32, 32, 4, 2
        return (64, 64, 4, 3) if max_rows <= 64 else (64, 64, 8, 3)
    if head_dim > 128:
        return 64, 32, 8, 2
    if max_rows <= 64:
        return 64, 64, 4, 3
    return 128, 64, 8, 3


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    interpreted: bool = False,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    total_q, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if total_q == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        # One small device->host read; pass max_query_len to avoid it (e.g. under CUDA graphs).
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return out
    upcast = interpreted or query.dtype == torch.float32
    scales, quantized = scale_args(key_cache, value_cache)  # 8-bit rows: their fp32 scales
    block_m, block_n, num_warps, num_stages = tile_config(
        head_dim, max_query_len * group, interpreted, upcast, quantized
    )
    block_m = max(block_m, triton.next_power_of_2(group))  # at least one query token per tile
    block_q = block_m // group  # query tokens per tile (each brings its group of heads)
    grid = (triton.cdiv(max_query_len, block_q), num_kv_heads, num_seqs)
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        float(scale) * LOG2E,
        group,
        block_q,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        *scales,
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d(head_dim),
        UPCAST=upcast,
        PRECISION=dot_precision(interpreted),
        QUANT=quantized,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
