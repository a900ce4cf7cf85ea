"""The KV cache's capacity in bytes and blocks: bytes per block from the model's dimensions and the
KV dtype, blocks from a memory budget, and blocks for a sequence's tokens.

One module because every side does this arithmetic and must get the same number: the block manager
turns ``--kv-cache-memory`` into its pool size, the cache host checks that the memory it allocates
per block is what the manager divided by, and ``pagedkv up`` computes the manager's bytes per block
from the model; the block manager, the engine, the worker and the kernels all count the blocks a
sequence's tokens fill (``blocks_for_tokens``). Pure arithmetic: no I/O, no torch, importable by
the core.

The KV dtypes (``--kv-cache-dtype``):

- ``auto``: K and V in the model's dtype (fp32 on CPU, bf16 on CUDA by default);
- ``int8``: symmetric int8, one fp32 scale per (token, KV head) for K and one for V;
- ``fp8_e4m3``: float8 e4m3 values with the same per-(token, KV head) fp32 scales.

An 8-bit row of one token and KV head is ``head_dim`` bytes of values followed by its 4-byte scale
(docs/kernels.md, "8-bit KV cache"), so the scales live inside their block and move with it.
"""

from __future__ import annotations

from typing import Literal, get_args

from pagedkv.arith import ceil_div

KvCacheDtype = Literal["auto", "int8", "fp8_e4m3"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
QUANTIZED: frozenset[str] = frozenset({"int8", "fp8_e4m3"})

GIB = 1 << 30
SCALE_BYTES = 4  # one fp32 scale per (token, KV head), for K and for V


def check_kv_cache_dtype(name: str) -> str:
    """``name`` if it is a KV cache dtype, else ValueError naming the choices."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return name


def is_quantized(kv_cache_dtype: str) -> bool:
    """True for the 8-bit KV dtypes (values plus scales), False for ``auto``."""
    return check_kv_cache_dtype(kv_cache_dtype) in QUANTIZED


def row_bytes(head_dim: int, kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes of one token's K (or V) row of one KV head: ``head_dim`` elements, plus the scale when
    8-bit."""
    if head_dim < 1 or model_dtype_bytes < 1:
        raise ValueError(f"head_dim and model_dtype_bytes must be >= 1, got {head_dim}, {model_dtype_bytes}")
    if is_quantized(kv_cache_dtype):
        return head_dim + SCALE_BYTES
    return head_dim * model_dtype_bytes


def block_bytes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    kv_cache_dtype: str,
    model_dtype_bytes: int,
) -> int:
    """Bytes of one block over all layers, K and V (scales included)."""
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("block_size", block_size)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    return num_layers * 2 * block_size * num_kv_heads * row_bytes(head_dim, kv_cache_dtype, model_dtype_bytes)


def memory_bytes(memory_gib: float) -> int:
    """A budget in GiB as whole bytes (rounded down)."""
    if not memory_gib >= 0:  # also refuses NaN
        raise ValueError(f"a memory budget must be >= 0 GiB, got {memory_gib}")
    return int(memory_gib * GIB)


def blocks_for_memory(budget_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks that fit in ``budget_bytes`` (rounded down)."""
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
    if budget_bytes < 0:
        raise ValueError(f"a memory budget must be >= 0 bytes, got {budget_bytes}")
    return budget_bytes // bytes_per_block


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that ``num_tokens`` tokens fill, the last one possibly partly (0 for no tokens)."""
    return ceil_div(num_tokens, block_size)


def blocks_per_gib(bytes_per_block: int) -> int:
    """Whole blocks in one GiB: the figure users compare KV dtypes by."""
    return blocks_for_memory(GIB, bytes_per_block)
