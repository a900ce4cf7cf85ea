"""The shape of the shared KV cache and the rules for agreeing on it.

The cache host, every worker and the block manager must agree on one geometry: a worker that reads
block 7 must find the same bytes the other worker wrote there. ``CacheGeometry`` is that value;
``check_same`` compares two of them and raises naming the first field that differs, so a
misconfigured deployment fails at start-up with an error that says what to fix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from pagedkv import kv_capacity

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# What a cache tensor may hold beyond the model dtypes: the 8-bit KV rows (kernels/quant.py).
STORAGE_DTYPES: dict[str, torch.dtype] = {**DTYPES, "int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
# --kv-cache-dtype -> the cache tensor's dtype ("auto": the model's).
KV_STORAGE: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


class GeometryMismatch(ValueError):
    """Two sources of the cache geometry disagree; the message names the value and both sides."""


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def storage_dtype_from_name(name: str) -> torch.dtype:
    """A cache tensor's dtype by name: a model dtype or an 8-bit KV storage dtype."""
    try:
        return STORAGE_DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(
            f"unsupported cache dtype {name!r}; expected one of {sorted(STORAGE_DTYPES)}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(slots=True, frozen=True)
class CacheGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    # "auto" (K/V in the model's dtype), "int8" or "fp8_e4m3" (pagedkv/kv_capacity.py).
    kv_cache_dtype: str = "auto"
    # Speculative decoding's draft model (--speculative-model; 0 layers: none). Its KV lives in
    # a second cache tensor indexed by the same block ids: block b holds the target's KV of its
    # tokens and the draft's, so the block manager's tables, rollbacks, prefix cache and frees
    # cover both (docs/speculative.md).
    draft_num_layers: int = 0
    draft_num_kv_heads: int = 0
    draft_head_dim: int = 0

    def __post_init__(self) -> None:
        kv_capacity.check_kv_cache_dtype(self.kv_cache_dtype)
        if self.draft_num_layers and (self.draft_num_kv_heads < 1 or self.draft_head_dim < 1):
            raise ValueError("a draft model's cache needs draft_num_kv_heads and draft_head_dim >= 1")

    @property
    def has_draft(self) -> bool:
        return self.draft_num_layers > 0

    def draft_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        """The draft model's cache: :meth:`shape` with the draft's layers, KV heads and head_dim."""
        row = kv_capacity.row_bytes(self.draft_head_dim, self.kv_cache_dtype, 1)
        return (self.draft_num_layers, 2, num_blocks, self.block_size, self.draft_num_kv_heads, row)

    def shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        """``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, row]``: ``row`` is head_dim,
        or head_dim + 4 for 8-bit KV (the values, then the row's fp32 scale: kernels/quant.py)."""
        row = kv_capacity.row_bytes(self.head_dim, self.kv_cache_dtype, 1)
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, row)

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The cache tensor's dtype: the model's, or the 8-bit KV dtype's storage."""
        return KV_STORAGE.get(self.kv_cache_dtype, model_dtype)

    @property
    def gpu_shape(self) -> tuple[int, int, int, int, int, int]:
        return self.shape(self.num_gpu_blocks)

    @property
    def cpu_shape(self) -> tuple[int, int, int, int, int, int]:
        return self.shape(self.num_cpu_blocks)

    def block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one block across all layers, K and V, scales included, for a model in ``dtype``
        (the draft model's layers too, when there is one)."""
        size = torch.empty((), dtype=dtype).element_size()
        target = kv_capacity.block_bytes(
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.kv_cache_dtype, size
        )
        if not self.has_draft:
            return target
        return target + kv_capacity.block_bytes(
            self.draft_num_layers,
            self.draft_num_kv_heads,
            self.draft_head_dim,
            self.block_size,
            self.kv_cache_dtype,
            size,
        )

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)


def check_same(expected: CacheGeometry, actual: CacheGeometry, expected_from: str, actual_from: str) -> None:
    """Raise ``GeometryMismatch`` naming every field where ``actual`` differs from ``expected``."""
    diffs = [
        f"{f.name}: {expected_from} has {getattr(expected, f.name)}, {actual_from} has "
        f"{getattr(actual, f.name)}"
        for f in fields(CacheGeometry)
        if getattr(expected, f.name) != getattr(actual, f.name)
    ]
    if diffs:
        raise GeometryMismatch("cache geometry mismatch: " + "; ".join(diffs))


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
