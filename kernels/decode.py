"""Paged decode attention in Triton: split-KV (flash-decoding) with a small reduce kernel.

Why split-KV: decode reads the whole KV context for one query token per sequence, so it is purely
memory-bound, and a grid of (sequence x kv head) programs is far too small to fill ~132 SMs when the
batch is small (batch 1 x 8 kv heads = 8 programs). Each sequence's context is therefore split
into ``num_splits`` ranges handled by separate programs, each writing a partial (normalised output,
log-sum-exp); ``_decode_reduce_kernel`` merges them. When the grid is already big enough (or the
context is short) the split count is 1 and the first kernel writes the final output directly.

GQA: one program serves all ``group = num_heads // num_kv_heads`` query heads of its kv head, so each
K/V tile is loaded once and used ``group`` times (a [group, D] x [D, BLOCK_N] dot). The group is
padded to 16 rows and head_dim to at least 16 columns because ``tl.dot`` needs M, K >= 16 on the
GPU (the interpreter accepts less, so ``pagedkv.kernels.aot`` compiles every configuration for sm_90 in CI).
Run-time sizes (heads, group, split count) are not specialised on: one binary per dtype and
head_dim serves every model shape.

Per-sequence split counts are computed on the device (a short sequence in a long batch is not cut
into tiny pieces; its unused split programs exit after writing an empty partial), so the host never
reads ``seq_lens``; the host picks the grid's split dimension from the batch size and an upper bound
of the context length (``max_seq_len`` if given, else the block table's capacity).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedkv.arith import ceil_div
from pagedkv.kernels.tile import attend_tile, dot_precision, scale_args

LOG2E = 1.4426950408889634
# Tuning knobs (see docs/kernels.md). A split covers at least this many tokens: below it the
# merge costs more than the parallelism gains.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# Aim for this many programs per SM so memory latency is hidden by several resident programs.
PROGRAMS_PER_SM = 4


# A Triton kernel, left unannotated: triton ships no types, and its compiler reads parameter
# annotations (tl.constexpr), so Python types there would mean something else.
@triton.jit(do_not_specialize=["num_heads", "group", "num_splits", "min_split_tokens", "window"])  # type: ignore[untyped-decorator]
def _decode_split_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    num_heads,
    group,
    num_splits,
    min_split_tokens,
    window,
    s_qs,
    s_qh,
    s_os,
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
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    # A sliding window (window > 0): the tiles start at the one holding the window's first token lo,
    # and that tile masks the tokens before it, so nothing before the window is read (its blocks may
    # have been released) and the work follows the window. Tiles stay BLOCK_N-aligned (unaligned
    # ones cost the split kernel registers it does not have at head_dim 128).
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    base = lo // BLOCK_N * BLOCK_N
    n_tiles = tl.cdiv(seq_len - base, BLOCK_N)
    # This sequence's own split count: no more than num_splits, each >= min_split_tokens.
    my_splits = tl.maximum(tl.minimum(num_splits, tl.cdiv(seq_len - base, min_split_tokens)), 1)
    tiles_per_split = tl.cdiv(n_tiles, my_splits)
    start = base + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < group
    dmask = d < HEAD_DIM
    heads = kvh * group + g
    q = tl.load(
        q_ptr + seq * s_qs + heads[:, None] * s_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_base = k_cache_ptr + kvh * s_kh
    v_base = v_cache_ptr + kvh * s_vh
    ks_base = k_scale_ptr + kvh * s_ksh  # unused unless QUANT
    vs_base = v_scale_ptr + kvh * s_vsh
    bt_row = block_tables_ptr + seq * s_bt
    q_pos = g  # unused: decode needs no causal mask (the query is the last token)

    if start < lo:  # the window's first tile: tokens before lo masked, not read
        acc, m_i, l_i = attend_tile(
            acc,
            m_i,
            l_i,
            q,
            k_base,
            v_base,
            bt_row,
            start,
            lo,
            end,
            q_pos,
            q_pos,
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
            False,
            UPCAST,
            PRECISION,
            QUANT,
        )

        start += BLOCK_N
    # Whole tiles without masks, then the ragged tail (if any) with one.
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for t in range(start, full_end, BLOCK_N):
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
            end,
            q_pos,
            q_pos,
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
    if full_end < end:
        acc, m_i, l_i = attend_tile(
            acc,
            m_i,
            l_i,
            q,
            k_base,
            v_base,
            bt_row,
            full_end,
            0,
            end,
            q_pos,
            q_pos,
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
            False,
            UPCAST,
            PRECISION,
            QUANT,
        )

    # An empty range (unused split, or seq_len == 0) leaves l_i == 0: write zeros and lse = -inf.
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    res = acc / safe_l[:, None]
    omask = gmask[:, None] & dmask[None, :]
    if SINGLE_SPLIT:
        tl.store(
            out_ptr + seq * s_os + heads[:, None] * s_oh + d[None, :],
            res.to(out_ptr.dtype.element_ty),
            mask=omask,
        )
    else:
        row = (seq * num_heads + heads) * num_splits + split  # [S, H, splits] layout
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], res, mask=omask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=gmask)


# A Triton kernel, left unannotated: triton ships no types, and its compiler reads parameter
# annotations (tl.constexpr), so Python types there would mean something else.
@triton.jit(do_not_specialize=["num_heads", "num_splits"])  # type: ignore[untyped-decorator]
def _decode_reduce_kernel(  # type: ignore[no-untyped-def]
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_heads,
    num_splits,
    s_os,
    s_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = sp < num_splits
    row = (seq * num_heads + head) * num_splits + sp
    lse = tl.load(part_lse_ptr + row, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no tokens at all: every weight is 0
    w = tl.exp2(lse - m)
    o = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=smask[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * s_os + head * s_oh + d, res.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; on CPU (interpreter) a small stand-in so the heuristic still splits."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int) -> int:
    """How many programs share one sequence's context (the grid's third dimension).

    Enough programs for ``PROGRAMS_PER_SM`` per SM, but never splits shorter than
    ``MIN_SPLIT_TOKENS``; 1 when (seq x kv head) programs alone already fill two per SM.
    """
    base = max(1, num_seqs * num_kv_heads)
    if base >= 2 * sms:
        return 1
    want = ceil_div(PROGRAMS_PER_SM * sms, base)
    useful = max(1, ceil_div(max_seq_len, MIN_SPLIT_TOKENS))
    return max(1, min(want, useful, MAX_SPLITS))


def tile_config(
    head_dim: int, interpreted: bool, upcast: bool = False, quantized: bool = False
) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for the split kernel.

    float32 on the GPU (``upcast``, tf32x3 dots) needs about three times the registers of a 16-bit
    tile: smaller tiles and one stage keep its spills small and its compile short (float32 is a
    correctness path, not a serving dtype; ``python -m pagedkv.kernels.aot`` prints what it uses).
    8-bit caches (``quantized``) widen each tile in registers and read its scales: shorter tiles
    above head_dim 64 keep sm_90 from spilling (64 keys spilled 56 B per thread at 128; at 256, 32
    keys spilled 120 B, and 16 keys over 4 warps still 8 B in some dtypes, over 8 warps none).
    """
    if interpreted:
        return 64, 4, 1
    if upcast:
        return (32, 4, 1) if head_dim <= 128 else (16, 8, 1)
    if quantized:
        return (64, 4, 3) if head_dim <= 64 else (32, 4, 3) if head_dim <= 128 else (16, 8, 2)
    if head_dim > 128:
        return 32, 4, 2
    if head_dim <= 32:  # tiny rows: longer tiles (64 made ptxas spill at head_dim 8 on sm_90)
        return 128, 4, 3
    return 64, 4, 3


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    interpreted: bool = False,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size  # an upper bound known without a sync
    if sliding_window is not None:  # the splits cut the window, not the context
        max_seq_len = min(max_seq_len, sliding_window)
    forced = num_splits is not None
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms(query.device))
    num_splits = max(1, int(num_splits))
    upcast = interpreted or query.dtype == torch.float32 or key_cache.dtype == torch.float32
    scales, quantized = scale_args(key_cache, value_cache)  # 8-bit rows: their fp32 scales
    block_n, num_warps, num_stages = tile_config(head_dim, interpreted, upcast, quantized)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16 on a GPU
    block_g = max(16, triton.next_power_of_2(group))
    single = num_splits == 1
    # A forced split count (tests, tuning) really splits even short contexts.
    min_split = 1 if forced else MIN_SPLIT_TOKENS
    if single:
        part_out = part_lse = out  # unused by the kernel
    else:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    grid = (num_seqs, num_kv_heads, num_splits)
    _decode_split_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        float(scale) * LOG2E,
        num_heads,
        group,
        num_splits,
        min_split,
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
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SINGLE_SPLIT=single,
        UPCAST=upcast,
        PRECISION=dot_precision(interpreted),
        QUANT=quantized,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            num_heads,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out
