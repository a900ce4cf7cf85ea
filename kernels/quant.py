"""The 8-bit KV cache format: quantize on write, dequantize in attention.

A layer's 8-bit cache is ``[num_blocks, block_size, num_kv_heads, head_dim + 4]`` of ``torch.int8``
(``--kv-cache-dtype int8``) or ``torch.float8_e4m3fn`` (``fp8_e4m3``): each (token, KV head) row holds
its ``head_dim`` 8-bit values and then the 4 bytes of its fp32 scale, ``x ~= value * scale``.

Why one scale per (token, KV head), inside the row:

- accuracy: a token is quantized against its own largest magnitude, so one outlier token (the first
  token's keys are often 10-100x the rest) costs only its own precision, where a scale per
  (block, KV head) spreads it over the block's other 15 tokens;
- writes stay writes: a token's row is final when written. A per-block scale grows as tokens arrive,
  so earlier rows would have to be re-quantized (a read-modify-write racing with readers, and a
  second rounding) or the scale guessed up front;
- the scales move with their blocks for free: copy-on-write, block copy and swap copy whole blocks,
  and prefix hits reuse them as they are, with no second tensor to keep in step;
- cost: 4 bytes per 8-bit row (6 % at head_dim 64, 3 % at 128), and one multiply per key and per
  value row in attention, folded into the dot product and the probability.

Symmetric, no zero point: K and V rows are centred near zero. int8 rounds to nearest (ties to even,
as ``torch.round`` and C's ``nearbyintf``) into [-127, 127] with ``scale = amax / 127``; fp8 e4m3 uses
``scale = amax / 448`` (its largest finite value). An all-zero row has scale 0 and dequantizes to 0.
The rows need ``head_dim % 4 == 0`` so the scale is 4-byte aligned.
"""

from __future__ import annotations

import torch

__all__ = [
    "QUANT_DTYPES",
    "SCALE_BYTES",
    "cache_dtype",
    "dequantize",
    "head_dim",
    "is_quantized",
    "quantize",
    "scales",
    "values",
]

SCALE_BYTES = 4
# The storage dtype of each 8-bit KV dtype and the largest magnitude it holds.
QUANT_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for a ``--kv-cache-dtype`` (``auto``: the model's)."""
    return model_dtype if kv_cache_dtype == "auto" else QUANT_DTYPES[kv_cache_dtype]


def is_quantized(cache: torch.Tensor | torch.dtype) -> bool:
    """Whether a cache (or its dtype) holds 8-bit rows with scales."""
    return (cache.dtype if isinstance(cache, torch.Tensor) else cache) in QMAX


def head_dim(cache: torch.Tensor) -> int:
    """The head size a cache holds: its last dim, less the scale's bytes when 8-bit."""
    return int(cache.shape[-1]) - (SCALE_BYTES if is_quantized(cache) else 0)


def values(cache: torch.Tensor) -> torch.Tensor:
    """The 8-bit values of an 8-bit cache, ``[..., head_dim]`` (a view)."""
    return cache[..., :-SCALE_BYTES]


def scales(cache: torch.Tensor) -> torch.Tensor:
    """The fp32 scales of an 8-bit cache, ``[...]`` one per row (a view: writes land in the cache)."""
    return cache[..., -SCALE_BYTES:].view(torch.float32).squeeze(-1)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [..., head_dim]`` as (8-bit values ``[..., head_dim]``, fp32 scales ``[...]``)."""
    qmax = QMAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = xf / safe.unsqueeze(-1)
    if dtype is torch.int8:
        q = y.round().clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp_(-qmax, qmax).to(dtype)
    return q, scale


def dequantize(cache: torch.Tensor) -> torch.Tensor:
    """An 8-bit cache (or any slice of whole rows of it) as fp32 ``[..., head_dim]``."""
    return values(cache).float() * scales(cache).unsqueeze(-1)


def pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Values and scales as 8-bit rows ``[..., head_dim + 4]`` (what a cache slot holds)."""
    rows = torch.empty((*q.shape[:-1], q.shape[-1] + SCALE_BYTES), dtype=q.dtype, device=q.device)
    values(rows).copy_(q)
    scales(rows).copy_(scale)
    return rows
