"""The "reference" kernel backend: the operations of ``pagedkv.kernels.backend.KernelBackend`` in plain torch.

Why it exists: it is the oracle the Triton and CPU backends are checked against. Attention gathers
each sequence's blocks into contiguous K/V and does softmax in float32, so the result is the
"exact" answer that the kernels' online softmax must match; block swaps go one block at a time.
Arguments are validated before they get here (``kernels/checks.py``); the contract of each
operation is documented once, on ``KernelBackend``. 8-bit caches (``kernels/quant.py``) are quantized
on write and dequantized to fp32 on read; block copies and swaps move their rows, scales included.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.arith import ceil_div
from pagedkv.kernels import quant
from pagedkv.kernels.backend import as_list, plan_nothing
from pagedkv.kv_capacity import blocks_for_tokens

__all__ = [
    "write_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "copy_blocks",
    "swap_blocks",
    "plan_decode",
    "plan_prefill",
]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token i's K/V at slot ``slot_mapping[i]`` (block * block_size + offset); -1 skips."""
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced-index assignment writes through strided views (e.g. a layer of a 6-D cache).
    key_cache[blocks, offsets] = _rows(key[keep], key_cache.dtype)
    value_cache[blocks, offsets] = _rows(value[keep], value_cache.dtype)


def _rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Tokens' K or V as the cache stores them: cast, or quantized with their scales."""
    if quant.is_quantized(dtype):
        return quant.pack(*quant.quantize(x, dtype))
    return x.to(dtype)


def _f32(rows: torch.Tensor) -> torch.Tensor:
    """Gathered cache rows as fp32 ``[..., head_dim]`` (8-bit ones dequantized)."""
    return quant.dequantize(rows) if quant.is_quantized(rows) else rows.float()


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous [length, num_kv_heads, head_dim] float32 K or V of one sequence."""
    block_size = cache.shape[1]
    n_blocks = blocks_for_tokens(length, block_size)
    ids = block_table[:n_blocks].to(device=cache.device, dtype=torch.int64)
    return _f32(cache[ids]).reshape(n_blocks * block_size, cache.shape[2], -1)[:length]


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
    out: torch.Tensor | None = None,
    plan: object | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its whole cached context (no causal mask needed),
    or to its last ``sliding_window`` tokens.

    Vectorised over the batch: gather every sequence's blocks up to the longest context, mask the
    tail, softmax in float32. With a window, each sequence's gather starts at the block holding its
    window's first token (earlier blocks are not read: they may have been released).
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    lens = seq_lens.to(device=query.device, dtype=torch.int64)
    width = block_tables.shape[1]
    if sliding_window is None:
        first_block = torch.zeros_like(lens)
    else:
        first_block = (lens - sliding_window).clamp(min=0) // block_size
    n_blocks = max(1, int((ceil_div(lens, block_size) - first_block).max()))
    cols = first_block.unsqueeze(1) + torch.arange(n_blocks, device=lens.device).unsqueeze(0)
    ids = block_tables.to(device=lens.device, dtype=torch.int64).gather(1, cols.clamp(max=width - 1))
    # Padding entries of a block table may hold garbage: clamp so the gather stays in bounds;
    # the tokens they hold are masked out below.
    ids = ids.to(key_cache.device).clamp(0, key_cache.shape[0] - 1)
    k = _f32(key_cache[ids]).reshape(num_seqs, n_blocks * block_size, num_kv_heads, head_dim)
    v = _f32(value_cache[ids]).reshape(num_seqs, n_blocks * block_size, num_kv_heads, head_dim)
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,stkd->skgt", q, k) * scale
    # Absolute position of each gathered slot.
    pos = (first_block * block_size).unsqueeze(1) + torch.arange(n_blocks * block_size, device=lens.device)
    valid = pos < lens.unsqueeze(1)
    if sliding_window is not None:
        valid &= pos >= (lens - sliding_window).unsqueeze(1)
    valid = valid.to(query.device)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a zero-length row attends to nothing
    # Slots past a sequence's length may hold anything (NaN included): probability 0 must mean 0.
    v = v.masked_fill(~valid[:, :, None, None], 0.0)
    res = torch.einsum("skgt,stkd->skgd", probs, v)
    out.copy_(res.reshape(num_seqs, num_heads, head_dim))
    return out


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
    out: torch.Tensor | None = None,
    plan: object | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's last ``q_len`` tokens over all ``seq_len`` cached tokens.

    Query j of a sequence sits at absolute position ``seq_len - q_len + j`` and sees keys
    ``0..that position``; so a chunk after a prefix-cache hit attends to the cached prefix too.
    With ``sliding_window`` W it sees keys ``max(0, position - W + 1)..position``, and the gather
    starts at the block holding the first query's first key.
    """
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q0, q1 = int(starts[i]), int(starts[i + 1])
        q_len = q1 - q0
        if q_len == 0:
            continue
        b0 = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1) // block_size
        table, n = block_tables[i, b0:], seq_len - b0 * block_size
        k = _gather_kv(key_cache, table, n).repeat_interleave(group, dim=1)
        v = _gather_kv(value_cache, table, n).repeat_interleave(group, dim=1)
        q = query[q0:q1].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(b0 * block_size, seq_len, device=query.device)
        hidden = k_pos[None, :] > q_pos[:, None]
        if sliding_window is not None:
            hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def copy_blocks(
    key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], pairs: torch.Tensor
) -> None:
    """Copy block ``src`` over block ``dst`` in every layer's K and V cache (copy-on-write)."""
    if pairs.numel() == 0:
        return
    for cache in list(key_caches) + list(value_caches):
        p = pairs.to(device=cache.device, dtype=torch.int64)
        cache[p[:, 1]] = cache[p[:, 0]]


def swap_blocks(
    src: torch.Tensor | Sequence[torch.Tensor],
    dst: torch.Tensor | Sequence[torch.Tensor],
    pairs: torch.Tensor,
) -> None:
    """One block at a time (one transfer per block): the oracle; ``kernels/swap.py`` batches."""
    for sc, dc in zip(as_list(src), as_list(dst), strict=True):
        for s, d in pairs.tolist():
            dc[int(d)].copy_(sc[int(s)])


# Nothing to plan: every call gathers what it needs.
plan_decode = plan_prefill = plan_nothing
