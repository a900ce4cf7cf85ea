"""The "triton" kernel backend: ``pagedkv.kernels.backend.KernelBackend`` on the Triton kernels.

The kernels live in ``decode.py``, ``prefill.py`` and ``cache_ops.py`` (one launch each, tuned per
head_dim); this module binds them to the contract: it passes whether they were built for Triton's
interpreter (TRITON_INTERPRET=1 at import: CPU tensors, how CI checks them) and uses the batched
torch swap (``swap.py``) for block swaps, which need no kernel. Importing it imports Triton.
"""

from __future__ import annotations

import torch

from pagedkv.kernels import cache_ops, decode, prefill
from pagedkv.kernels.backend import plan_nothing
from pagedkv.kernels.cache_ops import copy_blocks, write_kv_cache
from pagedkv.kernels.swap import swap_blocks

__all__ = [
    "write_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "copy_blocks",
    "swap_blocks",
    "plan_decode",
    "plan_prefill",
]

INTERPRETED = cache_ops.INTERPRETED


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
    return decode.paged_decode_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        scale,
        max_seq_len=max_seq_len,
        num_splits=num_splits,
        interpreted=INTERPRETED,
        out=out,
        sliding_window=sliding_window,
    )


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
    return prefill.paged_prefill_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        max_query_len=max_query_len,
        interpreted=INTERPRETED,
        out=out,
        sliding_window=sliding_window,
    )


# Nothing to plan: each launch reads the metadata on the device.
plan_decode = plan_prefill = plan_nothing
