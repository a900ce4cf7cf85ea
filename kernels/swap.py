"""Batched block swap between a GPU cache and a CPU (pinned) cache, in plain torch.

Why batched: the manager swaps a preempted sequence's blocks out and later back in; each block is
small (16 tokens x 8 heads x 128 x 2 B = 32 KiB per layer and K/V), and one DMA per block reaches only
a few GB/s. Instead we either copy contiguous runs directly (the pool allocator often hands out runs)
or gather the blocks into one contiguous staging buffer with ``index_select`` (a device kernel on
the GPU side), move that with a single transfer, and scatter with ``index_copy_`` on the other side.
The host-side staging buffer is pinned (when CUDA exists) and reused between calls.

The call is synchronous: when it returns, the destination holds the data (the worker runs swaps
before compute, and a synchronous contract keeps the reused staging buffer safe).

8-bit caches (``kernels/quant.py``) move as bytes (a ``uint8`` view of the same rows): whole rows,
so each row's scale travels with its values, and no gather or scatter has to support fp8.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import torch

from pagedkv.kernels import quant

# At most this many contiguous runs are copied directly; more go through the staging buffer.
MAX_DIRECT_RUNS = 4

_staging_lock = threading.Lock()
_staging: dict[tuple[torch.dtype, tuple[int, ...]], torch.Tensor] = {}


def contiguous_runs(pairs: list[list[int]]) -> list[tuple[int, int, int]]:
    """Group (src, dst) pairs into runs (src0, dst0, length) where both ids step by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in pairs:
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def contiguous_pieces(dst: torch.Tensor, src: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Split ``dst``/``src`` (same shape and memory order) along the dims outer in memory until
    each ``dst`` piece is contiguous (or the block dim is outermost, when no split helps)."""
    if dst.is_contiguous() or dst.dim() == 0:
        yield dst, src
        return
    outer = max(range(dst.dim()), key=lambda i: (dst.stride(i), -i) if dst.shape[i] > 1 else (-1, -i))
    if outer == 0:
        yield dst, src
        return
    for i in range(dst.shape[outer]):
        yield from contiguous_pieces(dst.select(outer, i), src.select(outer, i))


def copy_direct(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` as DMA straight between the two tensors' own memory.

    Why: the worker swaps through block-major views (``[N, L, 2, ...]`` permuted from the
    ``[L, 2, N, ...]`` caches) so one call moves every layer. A run of blocks in such a view is not
    contiguous, and torch copies a non-contiguous device->host pair through a pageable temporary
    (slow, and not into the pinned pool at all). Split along the dims that are outer in memory, each
    piece is contiguous on both sides: one DMA straight into (or out of) the pinned pool.
    """
    if dst.device == src.device:
        dst.copy_(src)
        return
    for d, s in contiguous_pieces(dst, src):
        d.copy_(s)


def _host_staging(dtype: torch.dtype, block_shape: tuple[int, ...], n: int) -> torch.Tensor:
    """A reusable host buffer of >= n blocks, pinned when CUDA is present (fast, async-capable DMA)."""
    key = (dtype, block_shape)
    buf = _staging.get(key)
    if buf is None or buf.shape[0] < n:
        cap = max(n, 2 * (0 if buf is None else buf.shape[0]))
        buf = torch.empty((cap, *block_shape), dtype=dtype, pin_memory=torch.cuda.is_available())
        _staging[key] = buf
    return buf[:n]


def _swap_one(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    n = pairs.shape[0]
    if n == 0:
        return
    if quant.is_quantized(src):
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    if src.device == dst.device:
        s = pairs[:, 0].to(device=src.device, dtype=torch.int64)
        d = pairs[:, 1].to(device=dst.device, dtype=torch.int64)
        dst.index_copy_(0, d, src.index_select(0, s))
        return
    host_pairs = pairs.tolist() if pairs.device.type == "cpu" else pairs.cpu().tolist()
    runs = contiguous_runs(host_pairs)
    if len(runs) <= MAX_DIRECT_RUNS:
        for s0, d0, length in runs:
            copy_direct(dst[d0 : d0 + length], src[s0 : s0 + length])
        return
    s = pairs[:, 0].to(device=src.device, dtype=torch.int64)
    d = pairs[:, 1].to(device=dst.device, dtype=torch.int64)
    block_shape = tuple(int(x) for x in src.shape[1:])
    with _staging_lock:
        if src.device.type == "cpu":  # host -> device: gather on the host into pinned memory
            host = _host_staging(src.dtype, block_shape, n)
            torch.index_select(src, 0, s, out=host)
            dst.index_copy_(0, d, host.to(dst.device))
        else:  # device -> host: gather on the device, one D2H copy, scatter on the host
            gathered = src.index_select(0, s)
            if dst.device.type == "cpu":
                host = _host_staging(src.dtype, block_shape, n)
                host.copy_(gathered)
                dst.index_copy_(0, d, host)
            else:  # device -> another device
                dst.index_copy_(0, d, gathered.to(dst.device))


def swap_blocks(
    src: torch.Tensor | Sequence[torch.Tensor],
    dst: torch.Tensor | Sequence[torch.Tensor],
    pairs: torch.Tensor,
) -> None:
    """Copy ``src[s] -> dst[d]`` for each row (s, d) of ``pairs``; block index on dim 0.

    ``src``/``dst`` are one cache tensor each, or equal-length sequences of them (per layer, K and V).
    """
    if isinstance(src, torch.Tensor):
        _swap_one(src, dst, pairs)  # type: ignore[arg-type]
        return
    for s_cache, d_cache in zip(src, dst, strict=True):
        _swap_one(s_cache, d_cache, pairs)
